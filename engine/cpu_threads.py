"""How many threads a CPU engine starts with (claim_threads: torch's count, or the cgroup's CPU quota where lower),
and how many a served step runs on: fewer while another process holds a core.

A step's OpenMP team meets at a barrier after each of its few hundred parallel regions, so it goes at the pace of
its least-scheduled thread. Where another process keeps a core busy, the team's thread that shares it runs about
half the time and every region waits for it: one busy process on a 2-core VM made two threads decode 5x slower
than one (docs/decisions.md, "Fewer CPU threads while a core is taken"). The scheduler says how long each thread
waited for a CPU while it could run (its run delay, /proc/self/task/<tid>/schedstat's second field), so the
governor reads that for the team's threads over each window of stepping: when the thread that waited most waited
for more than DROP of the window, the next steps run on as many threads as the team had CPUs (_fewer), at least
one fewer. After a while it tries one more again for a window and keeps it when the longest wait stayed under KEEP
(else the next try waits twice as long, up to PROBE_MAX_S). It never goes above the count the engine started with,
so a machine whose cores are the worker's own never leaves it. A CPU quota's throttling (a container's --cpus)
counts as run delay too (the 2-core VM, cgroup v1, 2 threads under a quota of one CPU: dropped to one), for a
quota set or lowered after the start.

The team: the step thread (the leader) names itself TEAM_NAME, opens one parallel region on all its threads, so
that libgomp starts every worker of its pool at once and each inherits the name (Linux copies a thread's name to
the threads it creates), then renames itself LEADER_NAME: threads it starts later (LoRA loaders, the KV pool's
prefault thread) carry that name and are not counted. The workers found, their ids are kept and they are renamed
WORKER_NAME, so that another engine starting in the process does not count them as its own; the team is found
again each time the count rises (_Team: libgomp ends and starts pool threads as teams shrink and grow). Only the
serving loop's step thread (AsyncEngine) is the leader for good; LLM.generate's is its calling thread, named
TEAM_NAME only while it starts its team and then given its own name back (for_calling_thread)."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.host_memory import cpu_quota, physical_cores
from engine.openmp import release_openmp_threads

log = logging.getLogger("engine")
TEAM_NAME = "llm-step"  # the step thread's OpenMP workers (15 characters at most: the kernel's limit)
LEADER_NAME = "llm-engine"  # the step thread itself, once its workers exist
WORKER_NAME = "llm-worker"  # its workers, once found
WINDOW_S = 0.5  # a window: this much time of stepping (restarted when the loop goes idle or runs an idle piece)
MIN_STEPS = 4  # and at least this many steps,
LONG_S = 1.0  # unless it is this long (a step this slow is no noise: under a busy core, a batch's prefill)
DROP = 0.3  # a team thread that waited for a CPU this share of the window: fewer threads (_fewer)
KEEP = 0.15  # a tried thread stays when the longest wait of its window stayed under this (no flapping at ~DROP)
PROBE_MIN_S = 0.05  # a try is undone as soon as its longest wait passes DROP over at least this long
PROBE_FIRST_S = 2.0  # after a drop, one more thread is tried again this much later, in seconds of windows
PROBE_MAX_S = 64.0  # the longest wait between tries (doubling after each try that found the cores taken)
SLACK = 0.25  # CPUs added to the team's estimate before it is rounded down (_fewer)
ADAPT = True  # False: the governor only measures (bench/contention.py's comparison)
QUOTA_CAP = True  # False: torch's own count under a CPU quota too (bench/contention.py's comparison)
TASKS = Path("/proc/self/task")


def claim_threads(cfg: EngineConfig, device: torch.device) -> int | None:
    """Rank 0's share of the machine: the current CUDA device (Triton launches on it, not on the tensors'), and
    torch's threads: cfg.num_threads where given, else default_threads. Returns the count to give back at shutdown
    where it changed torch's, else None."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
        return None
    if device.type != "cpu":
        return None
    before = torch.get_num_threads()
    threads, why = default_threads(cfg.tensor_parallel_size)
    if threads == before:
        return None
    log.info("CPU threads at start: %d, not torch's %d (%s)", threads, before, why)
    torch.set_num_threads(threads)
    return before


def default_threads(ranks: int = 1, quota: tuple[float, str] | None | bool = True) -> tuple[int, str]:
    """One of `ranks` CPU ranks' thread count where nobody chose one, and why. torch's count, unless it is its own
    default (a thread per CPU or per core) and the cgroup's CPU quota (`quota`: True reads it) is lower: then the
    quota rounded half up. Under a quota of one CPU on the 2-core VM, two threads decoded 15-25 % slower than one
    (spinning workers spend the quota, and the whole cgroup is throttled once it is spent); under 1.5 CPUs two beat
    one by 20-30 % (docs/decisions.md, "A CPU quota's share of threads"). On a large host with a small quota,
    torch's default would run a thread per host core. A count chosen equal to torch's default (OMP_NUM_THREADS)
    cannot be told from it and is capped too; num_threads is never capped."""
    threads, why = torch.get_num_threads(), "torch's count"
    quota = cpu_quota() if quota is True else quota
    host = set(range(os.cpu_count() or 1))
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else host
    # torch's default: a thread per CPU or per core, of the affinity mask (here) or of the host (builds whose count
    # comes from cpuinfo)
    own = {len(cpus), len(host), *((physical_cores(cpus), physical_cores(host)) if quota else ())}
    share = max(1, math.floor(quota[0] + 0.5)) if quota else threads  # half up: 1.5 CPUs -> 2, 1.05 -> 1
    if QUOTA_CAP and threads in own and share < threads:
        threads, why = share, f"the cgroup's CPU quota is {quota[0]:g} CPU{'s' * (quota[0] != 1)} ({quota[1]})"
    if ranks > 1:
        threads, why = max(1, threads // ranks), f"{why}, shared by {ranks} ranks"
    return threads, why


def read_team_delays(leader: int, tasks: Path = TASKS) -> dict[int, int]:
    """Run delay in ns of the leader (a thread id) and of each thread named TEAM_NAME: {tid: ns}."""
    return read_delays([t for t in _task_ids(tasks) if t == leader or _comm(tasks, t) == TEAM_NAME], tasks)


def read_delays(tids: list[int], tasks: Path = TASKS) -> dict[int, int]:
    """Run delay in ns of each of `tids` still running: {tid: ns}."""
    out = {}
    for t in tids:
        try:
            out[t] = int((tasks / str(t) / "schedstat").read_text().split()[1])
        except (OSError, ValueError, IndexError):  # the thread ended
            continue
    return out


def _task_ids(tasks: Path) -> list[int]:
    return [int(p.name) for p in tasks.iterdir() if p.name.isdigit()]


def _comm(tasks: Path, tid: int) -> str | None:
    try:
        return (tasks / str(tid) / "comm").read_text().strip()
    except OSError:  # the thread ended meanwhile
        return None


class _Team:
    """The step thread's OpenMP team: its thread ids, found by name (module docstring). libgomp ends the pool's
    threads past a smaller team's count and starts new ones when a team grows again (4 threads, then 2, then 4: two
    new workers), so the team is found again whenever the governor raises the count."""

    def __init__(self, leader: int, name: str = LEADER_NAME):
        self.leader, self.ids, self.name = leader, [leader], name  # name: the leader's own, between starts

    def start(self, threads: int) -> _Team:
        """On the leader's thread: one region on `threads` threads, under TEAM_NAME, so that the workers it starts
        inherit the name; those found are added and renamed WORKER_NAME (for `top -H`, and so that another engine's
        start does not take them); ended ones are dropped. Returns the team."""
        comm = Path("/proc/thread-self/comm")
        with _NAMING:  # one thread named TEAM_NAME at a time: two starting at once would take each other's workers
            try:
                comm.write_text(TEAM_NAME)
                torch.ones(threads << 16).add_(1)  # a region past torch's grain on every thread: the whole team
            finally:
                comm.write_text(self.name)
            live = set(_task_ids(TASKS))
            new = [t for t in read_team_delays(self.leader) if t != self.leader and t not in self.ids]
            for t in new:
                (TASKS / str(t) / "comm").write_text(WORKER_NAME)
        self.ids = [t for t in self.ids if t in live] + new
        return self

    def read(self) -> dict[int, int]:
        return read_delays(self.ids)


_NAMING = threading.Lock()  # held while a thread is named TEAM_NAME (_Team.start)
_CALLERS = threading.local()  # LLM.generate's: .team, the calling thread's (for_calling_thread)
_UNAVAILABLE: list[str] = []  # why no team can be made in this process (no schedstat, comm not writable): tried once


class ThreadGovernor:
    """On the step thread: after_step() once per step, restart() when the loop did something else (went idle, ran an
    idle piece), close() when it stops. It sets torch's thread count there (our C kernels read it at each call).
    `read`: the team's run delays ({tid: ns}; tests pass simulated ones); `apply`: sets the count; `clock`: seconds.
    `enabled` False: it measures (read) and changes nothing."""

    def __init__(
        self,
        max_threads: int,
        read: Callable[[], dict[int, int]],
        apply: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool = True,
        grown: Callable[[int], object] | None = None,
    ):
        self.max_threads = self.threads = max_threads
        self.read, self.apply, self.clock, self.enabled = read, apply, clock, enabled
        self.grown = grown  # called with the new count after a rise: the team's new threads are found (_Team.start)
        self.backoff = PROBE_FIRST_S
        self.since_change = 0.0  # seconds of windows since the count last changed
        self.probing = False  # this window runs one thread more than the last settled count
        self._stale = True  # the next step starts a window

    @classmethod
    def for_step_thread(cls, device: torch.device, tensor_parallel_size: int, threads: int) -> ThreadGovernor | None:
        """AsyncEngine's: make this (new) thread's OpenMP team of `threads` and name it (module docstring)."""
        return cls._over(device, tensor_parallel_size, threads, lambda: _Team(threading.get_native_id()).start(threads))

    @classmethod
    def for_calling_thread(cls, device: torch.device, tensor_parallel_size: int, threads: int) -> ThreadGovernor | None:
        """LLM.generate's: a governor over the calling thread's team, which keeps its own name. The team is made
        once a thread (_CALLERS), and again where its workers are gone (a drop ended them, or other work on the
        thread remade its pool): the thread's pool, started under its own name, is ended first
        (release_openmp_threads) so that a region under TEAM_NAME starts workers that can be found."""

        def team() -> _Team:
            kept = getattr(_CALLERS, "team", None)
            if kept is None or len(kept.read()) < threads:
                name = Path("/proc/thread-self/comm").read_text().strip()
                release_openmp_threads()
                kept = _CALLERS.team = _Team(threading.get_native_id(), name).start(threads)
            return kept

        return cls._over(device, tensor_parallel_size, threads, team)

    @classmethod
    def _over(cls, device, tensor_parallel_size, threads, team_of: Callable[[], _Team]) -> ThreadGovernor | None:
        """A governor over this thread's team of `threads` (`team_of` gives it, started) where one can work: CPU, one
        rank (a TP rank's steps must stay in step with the others', which read no delays of their own), Linux's /proc
        with schedstat and a writable comm (found once a process: _UNAVAILABLE). It acts (enabled) where there is a
        thread to drop and ADAPT is on."""
        if device.type != "cpu" or tensor_parallel_size > 1 or _UNAVAILABLE:
            return None
        torch.set_num_threads(threads)  # this thread's count (and torch's process-wide one) as the engine claimed it
        try:
            team = team_of()
        except (OSError, AttributeError) as e:
            _UNAVAILABLE.append(f"{type(e).__name__}: {e}")
            return None
        if team.leader not in team.read():
            _UNAVAILABLE.append("no schedstat")  # a kernel without it: nothing to measure
            return None
        return cls(threads, read=team.read, enabled=ADAPT and threads > 1, grown=team.start)

    def restart(self) -> None:
        """The loop did something else than steps: the window in progress is dropped, the next step starts one."""
        self._stale = True

    def close(self) -> None:
        """The loop stops: torch's count back to the engine's (set_num_threads is process-wide too)."""
        if self.threads != self.max_threads:
            self.apply(self.max_threads)
            self.threads = self.max_threads

    def _start_window(self) -> None:
        self.began, self.steps, self.delays, self._stale = self.clock(), 0, self.read(), False

    def before_step(self) -> None:
        """A step begins: where no window is open, one starts here, so that this step is in it."""
        if self.enabled and self._stale:
            self._start_window()

    def after_step(self) -> None:
        if not self.enabled:
            return
        if self._stale:  # no before_step: the window starts after this step
            return self._start_window()
        self.steps += 1
        window = self.clock() - self.began
        full = window >= WINDOW_S and (self.steps >= MIN_STEPS or window >= LONG_S)
        # a try is read after every step (its team's reads are a few small files): one that waits is undone after
        # its first slow step, not a whole window of them
        if not full and not (self.probing and window >= PROBE_MIN_S):
            return
        now = self.read()
        # each thread's share of the window it waited (a thread new in the window: all its delay)
        shares = [(now[t] - self.delays.get(t, 0)) / 1e9 / window for t in now]
        waited = max(shares, default=0)
        if self.probing and not full and waited <= DROP:
            return
        self.since_change += window
        if self.probing:  # the window ran one thread more: kept if the longest wait stayed low, else undone
            self.probing = False
            if waited >= KEEP:
                self.backoff = min(2 * self.backoff, PROBE_MAX_S)
                self._set(self.threads - 1, f"one more thread waited for a CPU {waited:.0%} of the window")
            else:
                self.backoff = PROBE_FIRST_S
                log.info("CPU threads: %d again (the longest wait %.0f%% of the window)", self.threads, 100 * waited)
        elif waited > DROP and self.threads > 1:
            self._set(self._fewer(shares), f"a step thread waited for a CPU {waited:.0%} of the last {window:.1f} s"
                      " (another process holds a core, or a CPU quota is spent)")  # fmt: skip
        elif self.threads < self.max_threads and self.since_change >= self.backoff:
            self.probing = True
            self._set(self.threads + 1, "trying one more")
        self._start_window()

    def _fewer(self, shares: list[float]) -> int:
        """The count after a window whose most-waiting thread waited past DROP: the CPUs the team had, as many
        threads as ran less what they waited (the pool's idle threads wait for nothing), rounded down after SLACK
        (measured waits scatter around whole CPUs), and at least one fewer. Under a quota of 2 CPUs a team of 16
        waits about 7/8 each and drops to 2 at once; with one busy process on 16 cores, to 15 (two busy: 15, then 14
        the window after)."""
        had = self.threads - sum(min(1.0, max(0.0, w)) for w in shares)
        return max(1, min(self.threads - 1, math.floor(had + SLACK)))

    def _set(self, threads: int, why: str) -> None:
        log.info("CPU threads %d -> %d: %s", self.threads, threads, why)
        rise = threads > self.threads
        self.threads, self.since_change = threads, 0.0
        self.apply(threads)
        if rise and self.grown is not None:
            try:
                self.grown(threads)
            except OSError:  # /proc went away: the team read stays as it was
                pass
