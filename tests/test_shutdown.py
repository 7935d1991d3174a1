"""SIGTERM, as Runpod sends it on scale-down, with 8 streaming jobs in flight through the emulator: each job
finishes within SHUTDOWN_GRACE_S or comes back FAILED with an error naming the shutdown; none stays
IN_PROGRESS; a job cancelled while the worker drains is still stopped; the worker exits by itself and leaves
no process behind (the emulator says so when it has to kill leftovers)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from bench.procs import Emulator

pytestmark = pytest.mark.slow  # the worker as a process, on the real SmolLM2

N = 8


def _emulator(smollm2_path, grace: float) -> Emulator:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_")}
    env.update(
        MODEL_NAME=str(smollm2_path),
        DTYPE="bfloat16",
        MAX_CONCURRENCY=str(N),
        MAX_MODEL_LEN="2048",
        HF_HUB_OFFLINE="1",
        SHUTDOWN_GRACE_S=str(grace),
    )
    return Emulator(env)


def _submit(emu: Emulator, max_tokens: int, first: int | None = None) -> list[str]:
    """N streamed jobs of max_tokens each (the first of `first`, when given); their ids."""

    def job(n: int) -> dict:
        params = {"temperature": 0, "max_tokens": n, "ignore_eos": True}
        prompt = "Tell me a long story about a lighthouse."
        return {"input": {"prompt": prompt, "stream": True, "sampling_params": params}}

    sizes = [max_tokens if first is None or i else first for i in range(N)]
    return [requests.post(f"{emu.base}/run", json=job(n), timeout=30).json()["id"] for n in sizes]


def _status(emu: Emulator, jid: str) -> dict:
    return requests.get(f"{emu.base}/status/{jid}", timeout=30).json()


def _wait(pred, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if v := pred():
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _all_streaming(emu: Emulator, ids: list[str]) -> None:
    """Every job is in the handler; a moment later each has its first tokens (so all 8 are in the engine)."""
    for j in ids:
        emu.wait_for(rf"job {j} started", 120)
    time.sleep(1.5)


def _sigterm_worker(emu: Emulator) -> None:
    os.kill(requests.get(f"{emu.base}/health", timeout=30).json()["localWorker"]["pid"], signal.SIGTERM)


def _worker_exited(emu: Emulator) -> dict | None:
    h = requests.get(f"{emu.base}/health", timeout=30).json()["localWorker"]
    return h if h["state"] == "exited" else None


def test_jobs_past_the_grace_period_fail_with_a_clear_error(smollm2_path):
    emu = _emulator(smollm2_path, grace=1)
    try:
        ids = _submit(emu, max_tokens=1500)  # ~1 min of decoding: none can finish in the grace period
        _all_streaming(emu, ids)
        t = time.time()
        _sigterm_worker(emu)
        worker = _wait(lambda: _worker_exited(emu), 60, "the worker to exit")
        took = time.time() - t
        finals = [_status(emu, j) for j in ids]
        assert all(f["status"] == "FAILED" for f in finals), [f["status"] for f in finals]
        assert all("shutting down" in str(f["error"]) and "grace period" in str(f["error"]) for f in finals), finals[0]
        assert worker["returncode"] == 0 and took < 1 + 15, (worker, took)  # grace + reporting, not a hang
        assert not any("left processes behind" in line for line in emu.lines)
    finally:
        emu.close()


def test_jobs_within_the_grace_period_finish_and_a_cancel_still_reaches_the_worker(smollm2_path):
    emu = _emulator(smollm2_path, grace=120)
    try:
        ids = _submit(emu, max_tokens=60, first=1500)  # the one to cancel: still decoding when the cancel comes
        _all_streaming(emu, ids)
        _sigterm_worker(emu)
        _wait(lambda: any("shutting down: no new jobs" in line for line in emu.lines), 30, "the drain to start")
        requests.post(f"{emu.base}/cancel/{ids[0]}", timeout=30)  # while the worker drains
        emu.wait_for(rf"job-stop -> worker: .*{ids[0]}", 30)
        emu.wait_for(rf"job {ids[0]} cancelled", 30)  # the handler saw it (its KV is freed)
        worker = _wait(lambda: _worker_exited(emu), 120, "the worker to exit")
        finals = [_status(emu, j) for j in ids]
        assert finals[0]["status"] == "CANCELLED"
        for f in finals[1:]:
            assert f["status"] == "COMPLETED", f
            assert f["output"][-1]["usage"]["output"] == 60  # the whole job, after SIGTERM
        assert worker["returncode"] == 0
        assert not any("left processes behind" in line for line in emu.lines)
    finally:
        emu.close()
