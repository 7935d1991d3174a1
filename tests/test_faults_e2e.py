"""Faults through the real worker processes (docs/decisions.md, "Faults"), driven by FAULT_INJECTION: a hung step
and a killed worker under the emulator (runpod's JobScaler, the platform's job protocol), and a hung step on a
load-balancing worker. Every job ends FAILED with an error that says why, none stays IN_PROGRESS, the worker exits
to be replaced, and the replacement on the same volume serves."""

from __future__ import annotations

import time

import httpx
import pytest
import requests

from bench.procs import Emulator, LBWorker, emulator_env

pytestmark = pytest.mark.slow  # the worker as a process, on the real SmolLM2

RESTART = ["-m", "handler.local", "--restart-worker"]


def _env(smollm2_path, **kw) -> dict:
    return emulator_env(MODEL_NAME=str(smollm2_path), DTYPE="bfloat16", MAX_CONCURRENCY="4", MAX_MODEL_LEN="2048", **kw)


def _job(max_tokens: int) -> dict:
    sp = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    return {"input": {"prompt": "Tell me a story about a lighthouse.", "stream": True, "sampling_params": sp}}


def _finals(emu: Emulator, ids: list[str], timeout: float = 120) -> list[dict]:
    deadline, finals = time.time() + timeout, {}
    while time.time() < deadline and len(finals) < len(ids):
        for j in ids:
            s = requests.get(f"{emu.base}/status/{j}", timeout=30).json()
            if s["status"] in ("COMPLETED", "FAILED", "CANCELLED"):
                finals[j] = s
        time.sleep(0.2)
    assert len(finals) == len(ids), f"jobs left unfinished: {set(ids) - set(finals)}\n{emu.tail()}"
    return [finals[j] for j in ids]


def _submit(emu: Emulator, n: int, max_tokens: int) -> list[str]:
    ids = [requests.post(f"{emu.base}/run", json=_job(max_tokens), timeout=30).json()["id"] for _ in range(n)]
    for j in ids:
        emu.wait_for(rf"job {j} started", 120)
    return ids


def _replacement_serves(emu: Emulator) -> None:
    """The restarted worker (same volume, same FAULT_INJECTION, whose step counts start again) serves a 2-step job."""
    [final] = _finals(emu, [requests.post(f"{emu.base}/run", json=_job(2), timeout=30).json()["id"]])
    assert final["status"] == "COMPLETED", final


def test_a_hung_step_fails_every_job_and_the_worker_exits_to_be_replaced(smollm2_path):
    env = _env(smollm2_path, FAULT_INJECTION="hang@6", STEP_TIMEOUT_S="2")
    with Emulator(env, argv=RESTART) as emu:
        ids = _submit(emu, 3, max_tokens=200)
        finals = _finals(emu, ids)
        assert all(f["status"] == "FAILED" and "STEP_TIMEOUT_S" in str(f["error"]) for f in finals), finals
        emu.wait_for(r"worker exited with code 1\b", 60)  # by itself: the platform replaces it
        assert any("engine fault" in line for line in emu.lines)
        _replacement_serves(emu)


def test_a_killed_worker_fails_its_jobs_and_a_new_one_starts_clean(smollm2_path):
    env = _env(smollm2_path, FAULT_INJECTION="kill@6")
    with Emulator(env, argv=RESTART) as emu:
        ids = _submit(emu, 3, max_tokens=200)
        finals = _finals(emu, ids)
        assert all(f["status"] == "FAILED" and "exited with code -9" in str(f["error"]) for f in finals), finals
        _replacement_serves(emu)


def test_a_load_balancing_worker_answers_503_then_exits_after_a_hung_step(smollm2_path):
    w = LBWorker(
        _env(smollm2_path, FAULT_INJECTION="hang@4", STEP_TIMEOUT_S="2", OPENAI_SERVED_MODEL_NAME_OVERRIDE="x")
    )
    try:
        body = {"model": "x", "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
        r = httpx.post(f"{w.base_url}/completions", json=body, timeout=60)
        assert r.status_code >= 500 and "STEP_TIMEOUT_S" in r.json()["error"]["message"], r.text
        assert w.ping() in (503, 0)  # unhealthy while it drains, then gone
        assert w.proc.wait(timeout=60) == 1, w.tail()
    finally:
        w.close()
