"""The CPU thread governor (engine/cpu_threads.py): its policy on simulated run delays, its reading of /proc, and
a served engine beside a busy process dropping to one thread."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import engine.cpu_threads as ct
from engine.cpu_threads import ThreadGovernor, read_team_delays

STEP = 1 / 16  # s: a binary fraction, so that steps add up to a window exactly


class Sim:
    """A team's run delays (tid -> ns) and a clock, both moved by step(), as the loop calls the governor. Threads
    100.. run (as many as its count; the pool's others sleep and wait for nothing). The team's threads in `busy`
    (the second one unless told) each wait `wait` of each step: each shares its core with a busy process. Under a
    `quota` of CPUs, every running thread waits what the quota leaves it short of a CPU."""

    def __init__(self, threads: int = 2, busy: tuple[int, ...] = (101,), quota: float | None = None):
        self.delays: dict[int, int] = {t: 0 for t in range(100, 100 + threads)}
        self.wait, self.now, self.busy, self.quota = 0.0, 0.0, busy, quota
        self.applied: list[int] = []
        self.gov = ThreadGovernor(
            threads, read=lambda: dict(self.delays), apply=self.applied.append, clock=lambda: self.now
        )

    def step(self, seconds: float = STEP) -> None:
        self.gov.before_step()
        n = self.gov.threads
        for t in range(100, 100 + n):
            share = max(0.0, 1 - self.quota / n) if self.quota else self.wait * (t in self.busy)
            self.delays[t] += int(share * seconds * 1e9)
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


def test_a_window_needs_its_steps_too_unless_it_is_long():
    s = Sim()
    s.wait = 0.45
    step = ct.LONG_S / ct.MIN_STEPS  # slow steps: the window's time is there before its steps are
    assert step * (ct.MIN_STEPS - 1) >= ct.WINDOW_S
    for _ in range(ct.MIN_STEPS - 1):
        s.step(step)
    assert s.applied == []
    s.step(step)
    assert s.applied == [1]
    s = Sim()  # one step as long as LONG_S (a batch's prefill beside a busy process) is a window: it is measured
    s.wait = 0.45
    s.step(ct.LONG_S)
    assert s.applied == [1]


def test_the_first_step_after_an_idle_gap_is_in_the_window():
    """The loop calls before_step: the window opens as the step begins, so a busy spell's first step counts (a
    governor told of a step only after it ran opens its window then)."""
    s = Sim()
    s.wait = 0.45
    s.gov.restart()
    s.step(ct.LONG_S)
    assert s.applied == [1]
    delays, now = {100: 0, 101: 0}, [0.0]
    gov = ThreadGovernor(2, read=lambda: dict(delays), apply=lambda n: None, clock=lambda: now[0])
    delays[101], now[0] = int(0.45 * ct.LONG_S * 1e9), ct.LONG_S
    gov.after_step()  # no before_step: this step opens the window, its own time is not in it
    assert gov.threads == 2


def test_fewer_threads_are_as_many_as_the_cpus_the_team_had():
    s = Sim(16, quota=2.0)  # a CPU quota of 2 on a team of 16: each waits 7/8
    s.run(ct.WINDOW_S)
    assert s.applied == [2]
    s.run(30)  # tries of a third thread wait a third of the time (past KEEP): undone each time
    assert set(s.applied) == {2, 3} and s.gov.threads == 2
    s = Sim(16)  # one busy process on 16 cores: one thread fewer
    s.wait = 0.5
    s.run(ct.WINDOW_S)
    assert s.applied == [15]
    s = Sim(16, busy=(101, 102))  # two: a thread fewer each window (the team had 15 CPUs by its waits)
    s.wait = 0.5
    s.run(2 * ct.WINDOW_S)
    assert s.applied == [15, 14]


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
    gov.before_step()
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


def test_default_threads_take_a_cpu_quota_below_torchs_own_count(monkeypatch):
    """A 16-CPU machine (simulated) whose cgroup has a quota: torch's own count (one a CPU) comes down to the quota
    rounded up; a count somebody chose (OMP_NUM_THREADS, set_num_threads) stays; TP ranks share what is left."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    f = "/sys/fs/cgroup/cpu.max"
    assert ct.default_threads(1, (2.0, f)) == (2, f"the cgroup's CPU quota is 2 CPUs ({f})")
    assert [ct.default_threads(1, (q, f))[0] for q in (1.5, 1.05, 1.0, 0.3, 2.5, 16.0, 40.0)] == [2, 1, 1, 1, 3, 16, 16]
    assert ct.default_threads(1, None) == (16, "torch's count")
    assert ct.default_threads(2, (4.0, f))[0] == 2 and "shared by 2 ranks" in ct.default_threads(2, (4.0, f))[1]
    monkeypatch.setattr(ct, "QUOTA_CAP", False)
    assert ct.default_threads(1, (2.0, f))[0] == 16
    monkeypatch.setattr(ct, "QUOTA_CAP", True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)  # chosen: not torch's own default
    assert ct.default_threads(1, (2.0, f))[0] == 6
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)  # 16 CPUs on 8 cores: torch's default is 8, capped
    monkeypatch.setattr(ct, "physical_cores", lambda cpus: 8)
    assert ct.default_threads(1, (2.0, f))[0] == 2


def test_claim_threads_sets_torchs_count_and_says_what_to_give_back(monkeypatch):
    from types import SimpleNamespace

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    monkeypatch.setattr(ct, "cpu_quota", lambda: (1.0, "cpu.max"))
    try:
        torch.set_num_threads(4)  # torch's own count on a (simulated) 4-CPU machine under a quota of one CPU
        assert ct.claim_threads(SimpleNamespace(num_threads=None, tensor_parallel_size=1), torch.device("cpu")) == 4
        assert torch.get_num_threads() == 1
        torch.set_num_threads(4)  # an engine told its count takes it, whatever the quota
        assert ct.claim_threads(SimpleNamespace(num_threads=3, tensor_parallel_size=1), torch.device("cpu")) is None
        assert torch.get_num_threads() == 3
        torch.set_num_threads(4)  # no quota: torch's count as it is
        monkeypatch.setattr(ct, "cpu_quota", lambda: None)
        assert ct.claim_threads(SimpleNamespace(num_threads=None, tensor_parallel_size=1), torch.device("cpu")) is None
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a quota of one CPU caps nothing on one CPU")
def test_an_engine_in_a_cgroup_with_a_cpu_quota_starts_with_the_quotas_threads(tiny_llama):
    """A real cgroup with a quota of one CPU (where this machine lets a test make one: root and a writable cgroup
    tree, as CI and this VM; elsewhere skipped, and the test above covers the arithmetic): the engine's count is 1
    while it runs, torch's own again after shutdown."""
    from bench.procs import cpu_cgroup

    made = cpu_cgroup(f"llm-quota-test-{os.getpid()}", 1.0)
    if made is None:
        pytest.skip("no writable CPU cgroup here (not root, or a read-only /sys/fs/cgroup)")
    procs, d = made
    code = (
        f"import os; open({str(procs)!r}, 'w').write(str(os.getpid()))\n"
        "import torch\nfrom engine import LLM\nbefore = torch.get_num_threads()\n"
        f"llm = LLM(model={str(tiny_llama)!r}, dtype='float32')\n"
        "during = torch.get_num_threads(); llm.engine.shutdown()\n"
        "print(before, during, torch.get_num_threads())\n"
    )
    try:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # conftest's 1 under xdist: torch's own
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    finally:
        d.rmdir()
    assert out.returncode == 0, out.stderr[-2000:]
    before, during, after = map(int, out.stdout.split()[-3:])  # torch's own count: a thread per CPU, or per core
    if before < 2:
        pytest.skip(f"torch's own count here is {before}: a quota of one CPU caps nothing")
    assert (during, after) == (1, before)


def test_the_team_is_found_again_when_it_grows():
    """libgomp ends the pool's threads past a smaller team and starts new ones when it grows: after 4 -> 2 -> 4, the
    governor reads the new workers (found under TEAM_NAME, renamed WORKER_NAME), not the ended ones."""
    got = {}

    def body():
        before = torch.get_num_threads()
        try:
            gov = ThreadGovernor.for_step_thread(torch.device("cpu"), 1, 4)
            got["first"] = set(gov.read())
            gov._set(2, "test")
            torch.ones(2 << 16).add_(1)  # a region of 2: libgomp ends the other two workers
            time.sleep(0.1)
            gov._set(4, "test")
            got["again"] = set(gov.read())
            got["names"] = {t: (ct.TASKS / str(t) / "comm").read_text().strip() for t in got["again"]}
            got["leader"] = threading.get_native_id()
        finally:
            torch.set_num_threads(before)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    first, again, names = got["first"], got["again"], got["names"]
    assert len(first) == 4 and len(again) == 4, (first, again)
    assert again - first, "no new worker read after the team grew"
    assert all(names[t] == (ct.LEADER_NAME if t == got["leader"] else ct.WORKER_NAME) for t in again), names


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin the engine and the busy processes to")
def test_llm_generate_beside_busy_processes_steps_on_fewer_threads(smollm2_path, caplog):
    """The offline API governs its calling thread's team too: beside two busy processes on the same 2 CPUs, a long
    generate drops to one thread; afterwards the thread has its own name and torch's count back."""
    import logging

    from engine import LLM, SamplingParams

    cpus, before = set(sorted(os.sched_getaffinity(0))[:2]), os.sched_getaffinity(0)
    busy = f"import os; os.sched_setaffinity(0, {cpus}); exec('while True: pass')"
    comm = Path("/proc/thread-self/comm")
    name, count = comm.read_text().strip(), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)  # this thread's, and its workers' (made before and after)
    llm = LLM(model=str(smollm2_path), dtype="bfloat16", num_threads=2, log_stats_interval=0)
    hogs = [subprocess.Popen([sys.executable, "-c", busy]) for _ in range(2)]
    try:
        with caplog.at_level(logging.INFO, logger="engine"):
            out = llm.generate("The history of the Roman Empire", SamplingParams(temperature=0, max_tokens=192,
                                                                                ignore_eos=True))  # fmt: skip
        assert len(out[0].outputs[0].token_ids) == 192
        said = [r.getMessage() for r in caplog.records]
        assert any("CPU threads 2 -> 1" in m for m in said), said
        assert comm.read_text().strip() == name and torch.get_num_threads() == 2
    finally:
        for h in hogs:
            h.kill()
        os.sched_setaffinity(0, before)
        llm.engine.shutdown()
        torch.set_num_threads(count)  # num_threads=2 is not given back by the engine


def test_two_threads_making_their_teams_at_once_keep_their_own():
    """Teams are found by name: two threads starting theirs at the same moment must not take each other's workers
    (one thread named TEAM_NAME at a time), and each keeps its own name."""
    got, meet = {}, threading.Barrier(2)

    def body(k):
        before, comm = torch.get_num_threads(), Path("/proc/thread-self/comm")
        comm.write_text(f"caller-{k}")
        try:
            for _ in range(20):
                meet.wait()
                ct._CALLERS.__dict__.pop("team", None)  # this thread's team made afresh each round
                gov = ThreadGovernor.for_calling_thread(torch.device("cpu"), 1, 2)
                ids = set(gov.read())
                got.setdefault(k, []).append((ids, comm.read_text().strip()))
        finally:
            torch.set_num_threads(before)

    threads = [threading.Thread(target=body, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (a, name_a), (b, name_b) in zip(got[0], got[1]):
        assert len(a) == 2 and len(b) == 2 and not a & b, (a, b)
        assert (name_a, name_b) == ("caller-0", "caller-1")
