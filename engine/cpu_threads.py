"""How many threads a served CPU step runs on: fewer while another process holds a core.

A step's OpenMP team meets at a barrier after each of its few hundred parallel regions, so it goes at the pace of
its least-scheduled thread. Where another process keeps a core busy, the team's thread that shares it runs about
half the time and every region waits for it: one busy process on a 2-core VM made two threads decode 5x slower
than one (docs/decisions.md, "Fewer CPU threads while a core is taken"). The scheduler says how long each thread
waited for a CPU while it could run (its run delay, /proc/self/task/<tid>/schedstat's second field), so the
governor reads that for the team's threads after every window of stepping: when the thread that waited most waited
for more than DROP of the window, the next steps run one thread fewer. Every so often it tries one more again for
a window, keeps it when nobody waited, and backs off (doubling, up to PROBE_MAX_S) when they did. It never goes
above the count the engine started with, and a machine whose cores are the worker's own never leaves it.

The team: the step loop's thread names itself (TEAM_NAME) before its first parallel region, and the OpenMP
workers it starts inherit the name (Linux copies a thread's name to the threads it creates). Only the serving
loop (AsyncEngine) has a governor: LLM.generate runs on the caller's thread, whose name is the caller's."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("engine")
TEAM_NAME = "llm-step"  # 15 characters at most (the kernel's limit)
WINDOW_S = 0.5  # of step time: a window's run delays are compared with it
MIN_STEPS = 4  # a window holds at least this many steps
DROP = 0.3  # a team thread that waited for a CPU this share of the window: one thread fewer
PROBE_FIRST_S = 2.0  # after a drop, one more thread is tried again this much later, in seconds of steps
PROBE_MAX_S = 64.0  # the longest wait between tries (doubling after each try that found the cores taken)
ADAPT = True  # False: steps keep the count the engine started with (bench/contention.py's comparison)
TASKS = Path("/proc/self/task")


def read_team_delays(tasks: Path = TASKS) -> dict[int, int]:
    """Run delay in ns of each thread named TEAM_NAME: {tid: ns}."""
    out = {}
    for task in tasks.iterdir():
        try:
            if (task / "comm").read_text().strip() == TEAM_NAME:
                out[int(task.name)] = int((task / "schedstat").read_text().split()[1])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return out


class ThreadGovernor:
    """after_step(seconds) once per step, on the step thread; it sets torch's thread count there (our C kernels
    read it at each call). `read`: the team's run delays ({tid: ns}, tests pass simulated ones); `apply`: sets the
    count (torch.set_num_threads)."""

    def __init__(
        self,
        max_threads: int,
        read: Callable[[], dict[int, int]] = read_team_delays,
        apply: Callable[[int], None] = torch.set_num_threads,
    ):
        self.max_threads = self.threads = max_threads
        self.read, self.apply = read, apply
        self.backoff = PROBE_FIRST_S
        self.since_change = 0.0  # seconds of steps since the count last changed
        self.probing = False  # this window runs one thread more than the last settled count
        self._start_window()

    @classmethod
    def for_step_thread(cls, device: torch.device, tensor_parallel_size: int) -> ThreadGovernor | None:
        """Name this thread the team's; a governor where it can work: CPU, more than one thread, one rank (a TP
        rank's threads are its own process's), run delays readable (Linux with schedstats)."""
        threads = torch.get_num_threads()
        if device.type != "cpu" or tensor_parallel_size > 1:
            return None
        try:  # named even when the governor is off: `top -H` shows it, bench/contention.py reads its delays
            (TASKS / str(threading.get_native_id()) / "comm").write_text(TEAM_NAME)
            if not read_team_delays():
                return None
        except (OSError, AttributeError):
            return None
        return cls(threads) if ADAPT and threads > 1 else None

    def _start_window(self) -> None:
        self.window_s, self.steps, self.delays = 0.0, 0, self.read()

    def after_step(self, seconds: float) -> None:
        self.window_s += seconds
        self.steps += 1
        self.since_change += seconds
        if self.window_s < WINDOW_S or self.steps < MIN_STEPS:
            return
        now = self.read()
        # the share of the window the most-waiting thread waited (a thread new in the window: all its delay)
        waited = max((now[t] - self.delays.get(t, 0) for t in now), default=0) / 1e9 / self.window_s
        if self.probing:  # the window ran one thread more: keep it if nobody waited, else back to where it was
            self.probing = False
            if waited > DROP:
                self.backoff = min(2 * self.backoff, PROBE_MAX_S)
                self._set(self.threads - 1, f"one more thread waited for a CPU {waited:.0%} of the window")
            else:
                self.backoff = PROBE_FIRST_S
                log.info("CPU threads: %d again (the cores are free)", self.threads)
        elif waited > DROP and self.threads > 1:
            self._set(self.threads - 1, f"a step thread waited for a CPU {waited:.0%} of the last {self.window_s:.1f} s"
                      " (another process holds a core)")  # fmt: skip
        elif self.threads < self.max_threads and self.since_change >= self.backoff:
            self.probing = True
            self._set(self.threads + 1, "trying one more")
        self._start_window()

    def _set(self, threads: int, why: str) -> None:
        if threads != self.threads:
            log.info("CPU threads %d -> %d: %s", self.threads, threads, why)
        self.threads, self.since_change = threads, 0.0
        self.apply(threads)
