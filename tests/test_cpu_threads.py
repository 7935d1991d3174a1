"""The CPU thread governor (engine/cpu_threads.py): its policy on simulated run delays, its reading of /proc, and
a served engine beside a busy process dropping to one thread."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
import torch

import engine.cpu_threads as ct
from engine.cpu_threads import ThreadGovernor, read_team_delays

STEP = 1 / 16  # s: a binary fraction, so that steps add up to a window exactly


class Sim:
    """A team's run delays (tid -> ns) and a clock, both moved by step(): the team's second thread, when it runs,
    waits `wait` of each step (it shares its core with the busy process; the first has one to itself)."""

    def __init__(self):
        self.delays: dict[int, int] = {}
        self.wait, self.now = 0.0, 0.0
        self.applied: list[int] = []
        self.gov = ThreadGovernor(2, read=lambda: dict(self.delays), apply=self.applied.append, clock=lambda: self.now)
        self.gov.after_step()  # the first step starts the first window

    def step(self, seconds: float = STEP) -> None:
        for t in range(100, 100 + self.gov.threads):
            self.delays[t] = self.delays.get(t, 0) + int(self.wait * seconds * 1e9) * (t == 101)
        self.now += seconds
        self.gov.after_step()

    def run(self, seconds: float, step: float = STEP) -> None:
        for _ in range(round(seconds / step)):
            self.step(step)

    def until_applied(self, limit: float, step: float = STEP) -> float:
        """Step until the governor sets a count; the seconds of steps that took (inf: none within `limit`)."""
        n, t = len(self.applied), 0.0
        while len(self.applied) == n:
            if t > limit:
                return float("inf")
            self.step(step)
            t += step
        return t


def test_free_cores_keep_every_thread():
    s = Sim()
    s.wait = 0.05
    s.run(120)
    assert s.applied == [] and s.gov.threads == 2


def test_a_team_thread_waiting_for_a_cpu_drops_one_thread_after_one_window():
    s = Sim()
    s.wait = 0.45
    s.run(ct.WINDOW_S - STEP)
    assert s.applied == []  # the window is not full yet
    s.step()
    assert s.applied == [1] and s.gov.threads == 1


def test_a_window_needs_its_steps_too():
    s = Sim()
    s.wait = 0.45
    for _ in range(ct.MIN_STEPS - 1):
        s.step(1.0)  # long steps: the time is there, the steps are not
    assert s.applied == []
    s.step(1.0)
    assert s.applied == [1]


def test_what_the_loop_does_between_steps_is_no_window():
    """An idle piece or an idle gap (restart) drops the window in progress: its waits are not the steps'."""
    s = Sim()
    s.wait = 0.45
    s.run(ct.WINDOW_S - STEP)
    s.gov.restart()
    s.wait = 0.0
    s.run(4 * ct.WINDOW_S)
    assert s.applied == []


def test_disabled_it_measures_and_changes_nothing():
    s = Sim()
    s.gov.enabled = False
    s.wait = 0.9
    s.run(10)
    assert s.applied == [] and s.gov.threads == 2


def test_close_gives_torch_the_engines_count_back():
    s = Sim()
    s.wait = 0.45
    s.run(ct.WINDOW_S)
    assert s.gov.threads == 1
    s.gov.close()
    assert s.applied == [1, 2] and s.gov.threads == 2


def test_tries_again_backs_off_while_the_core_stays_taken_and_returns_when_it_is_free():
    s = Sim()
    s.wait = 0.45
    assert s.until_applied(10) == pytest.approx(ct.WINDOW_S) and s.applied == [1]
    waited = s.until_applied(30)  # one thread alone waits for nothing: then one more is tried
    assert s.applied == [1, 2] and ct.PROBE_FIRST_S <= waited <= ct.PROBE_FIRST_S + ct.WINDOW_S
    # it waited: undone after its first step, not a whole window of slow ones
    assert s.until_applied(10) == pytest.approx(STEP) and s.applied == [1, 2, 1]
    assert s.gov.backoff == 2 * ct.PROBE_FIRST_S
    waited = s.until_applied(30)
    assert s.applied == [1, 2, 1, 2] and 2 * ct.PROBE_FIRST_S <= waited <= 2 * ct.PROBE_FIRST_S + ct.WINDOW_S
    s.wait = 0.2  # between KEEP and DROP: a try is undone, a settled count is not dropped
    assert s.until_applied(10) == pytest.approx(ct.WINDOW_S) and s.applied == [1, 2, 1, 2, 1]
    s.wait = 0.0  # the core is free now: the next try holds, and nothing changes after it
    s.run(60)
    assert s.applied == [1, 2, 1, 2, 1, 2] and s.gov.threads == 2 and s.gov.backoff == ct.PROBE_FIRST_S


def test_a_settled_count_waiting_between_keep_and_drop_stays():
    s = Sim()
    s.wait = 0.2
    s.run(60)
    assert s.applied == []


def test_the_wait_between_tries_stops_doubling_at_its_cap():
    s = Sim()
    s.wait = 0.45
    for _ in range(12):
        s.run(ct.PROBE_MAX_S + ct.WINDOW_S)
    assert s.gov.backoff == ct.PROBE_MAX_S and max(s.applied) == 2 and min(s.applied) == 1


def test_a_thread_new_in_the_window_counts_all_its_delay():
    delays, now = {100: 0}, [0.0]
    gov = ThreadGovernor(2, read=lambda: dict(delays), apply=lambda n: None, clock=lambda: now[0])
    gov.after_step()
    delays[101] = int(0.4 * ct.WINDOW_S * 1e9)  # started during the window (a try's new worker)
    for _ in range(ct.MIN_STEPS):
        now[0] += ct.WINDOW_S / ct.MIN_STEPS
        gov.after_step()
    assert gov.threads == 1


def test_read_team_delays_takes_the_leader_and_the_named_workers(tmp_path):
    threads = [
        (7, ct.LEADER_NAME, "900 250 3"),
        (8, "python", "5 999 1"),
        (9, ct.TEAM_NAME, "1 40 2"),
        (11, ct.LEADER_NAME, "1 777 1"),
    ]  # fmt: skip  (11: a thread the leader started later)
    for tid, name, stat in threads:
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "comm").write_text(name + "\n")
        (tmp_path / str(tid) / "schedstat").write_text(stat + "\n")
    (tmp_path / "10").mkdir()  # a thread that ended between the listing and the read
    assert read_team_delays(7, tmp_path) == {7: 250, 9: 40}


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin the engine and the busy processes to")
def test_a_served_engine_beside_busy_processes_steps_on_one_thread(smollm2_path):
    """The engine's threads and two busy processes pinned to the same 2 CPUs: a team thread waits for a CPU, and the
    step loop drops to one thread while it serves. The team is the leader and its one OpenMP worker, not the
    threads the leader starts later; the step thread's torch count follows, and comes back at shutdown."""
    from engine import AsyncEngine, SamplingParams

    cpus, before = set(sorted(os.sched_getaffinity(0))[:2]), os.sched_getaffinity(0)
    busy = f"import os; os.sched_setaffinity(0, {cpus}); exec('while True: pass')"
    os.sched_setaffinity(0, cpus)  # this thread's: the step thread and its workers inherit it
    hogs = [subprocess.Popen([sys.executable, "-c", busy]) for _ in range(2)]
    eng = AsyncEngine(model=str(smollm2_path), dtype="bfloat16", num_threads=2, log_stats_interval=0)
    try:
        seen = []

        async def serve_until_dropped() -> dict:
            params = SamplingParams(temperature=0, max_tokens=1024, ignore_eos=True)
            team, deadline = {}, time.monotonic() + 60
            async for _ in eng.generate("The history of the Roman Empire", params):
                team = team or eng.governor.read()
                if eng.governor.threads == 1 or time.monotonic() > deadline:
                    break
            eng.warm_later(lambda: seen.append(torch.get_num_threads()))  # run by the step thread, once idle
            while not seen:
                await asyncio.sleep(0.05)
            return team

        team = asyncio.run(serve_until_dropped())
        assert eng.governor.enabled and eng.governor.max_threads == 2
        assert len(team) == 2, f"the team's threads: {team}"
        assert eng.governor.threads == 1 and seen == [1]
    finally:
        for h in hogs:
            h.kill()
        eng.shutdown()
        os.sched_setaffinity(0, before)
    assert eng.governor.threads == 2  # close(): torch's count is the engine's again


def test_two_engines_in_one_process_each_count_their_own_team(tiny_llama):
    """The second engine's start must not take the first's workers for its own (they are renamed once found)."""
    from engine import AsyncEngine, SamplingParams

    engines = [AsyncEngine(model=str(tiny_llama), dtype="float32", num_threads=2) for _ in range(2)]
    try:

        async def one(eng):
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            return [o async for o in eng.generate({"prompt_token_ids": [5, 17, 42]}, params)]

        for eng in engines:  # a request: the step loop has started, and made its governor
            asyncio.run(one(eng))
        a, b = (set(eng.governor.read()) for eng in engines)
        assert len(a) == 2 and len(b) == 2 and not a & b, (a, b)
    finally:
        for eng in engines:
            eng.shutdown()
