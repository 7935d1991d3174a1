"""The machine failing under the engine (docs/decisions.md, "Faults"), injected through FAULT_INJECTION's path and
faked exceptions on a tiny model: out of memory in a step (split retry, then the largest request fails), NaN logits
(that row's request fails), a hung step (the watchdog fails everything), a device error (a fault at once). Each
asserts what the user sees and that nothing else is lost: every other request's tokens equal a clean run's, and
every block returns to the pool."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine import AsyncEngine, EngineConfig, EngineFault, RequestFault, SamplingParams
from engine.block_manager import BlockManager
from engine.faults import OOM_LIMIT, OomHistory, parse_fault_injection
from engine.llm_engine import LLMEngine
from engine.scheduler import Scheduler
from engine.types import Request
from engine.types import SamplingParams as SP

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5 + i, 9, 17 + i, 33, 41, 7 + i, 60, 3, 11, 12 + i, 80, 90] for i in range(4)]


def engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", log_stats_interval=0, num_kv_blocks=64, block_size=8)
    return LLMEngine(EngineConfig(**(cfg | kw)))


def run(eng: LLMEngine, prompts, params=GREEDY) -> dict:
    """Every request to the end: {id: token ids, or the error it failed with}; asserts the pool is whole after."""
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    got = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.error is not None:
                got[out.request_id] = out.error
            elif out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and sum(bm.ref_counts) == 0, "a block was not returned"
    return dict(sorted(got.items()))


@pytest.fixture(scope="module")
def clean(tiny_llama) -> dict:
    return run(engine(tiny_llama), PROMPTS)


def test_fault_injection_is_parsed_and_refused_by_name():
    assert parse_fault_injection(" oom@3, nan@1,hang@20,kill@2 ") == (("oom", 3), ("nan", 1), ("hang", 20), ("kill", 2))
    assert parse_fault_injection("") == ()
    for bad in ("oom", "oom@0", "boom@1", "nan@x"):
        with pytest.raises(ValueError, match="KIND@STEP"):
            parse_fault_injection(bad)


def test_a_malformed_fault_injection_is_a_start_error_naming_the_variable():
    from handler.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="FAULT_INJECTION"):
        load_settings({"FAULT_INJECTION": "oom@3,explode@4"})
    with pytest.raises(SettingsError, match="STEP_TIMEOUT_S"):
        load_settings({"STEP_TIMEOUT_S": "0"})


def test_oom_in_a_step_is_retried_halved_and_loses_nothing(tiny_llama, clean):
    eng = engine(tiny_llama, fault_injection="oom@1,oom@4")
    assert run(eng, PROMPTS) == clean  # each OOM'd step ran again, halved: the same tokens for everyone
    assert eng.ooms.count == 2 and eng.unhealthy is None
    assert eng.scheduler.num_preemptions >= 2  # the newest half of each step went back to the queue


def test_an_oom_that_repeats_fails_the_largest_request_only(tiny_llama, clean, monkeypatch):
    """A real allocation failure (a faked torch.cuda.OutOfMemoryError from the forward) whenever one request's
    prompt logprobs are in the step: the halved retry fails too, that request fails saying what would fit, and the
    others finish as in a clean run."""
    eng = engine(tiny_llama)
    runner = eng.step_runner.runner
    forward = runner.forward

    def forward_oom(batch):
        if 300 in batch.input_ids:  # the big request's prefill
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return forward(batch)

    monkeypatch.setattr(runner, "forward", forward_oom)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    big = SamplingParams(max_tokens=6, prompt_logprobs=5)
    eng.add_request("big", {"prompt_token_ids": [300, *PROMPTS[3][1:]]}, big)
    got = {}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] = out.error if out.error is not None else out.outputs[0].token_ids
    err = got.pop("big")
    assert isinstance(err, RequestFault) and err.status == 503 and err.field == "prompt_logprobs"
    assert "did not fit in device memory" in str(err) and "fewer prompt_logprobs" in str(err)
    assert got == {k: v for k, v in clean.items() if k != "r3"}
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_rolled_back_step_leaves_no_uncomputed_block_in_the_prefix_cache():
    """Blocks a failed step registered for prefix caching hold no KV: the roll-back forgets them, so a later
    request cannot be served another's garbage."""
    bm = BlockManager(num_blocks=16, block_size=4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a = Request("a", list(range(1, 13)), SP(max_tokens=4), eos_token_ids=frozenset({0}))
    a.cache_key = ("base",)
    s.add(a)
    out = s.schedule()
    assert len(bm.cached) == 3  # registered when allocated, for the step that would fill them
    s.halve(out)
    assert bm.cached == {} and a.num_computed_tokens == 0 and a.block_ids == []
    assert bm.num_free_blocks == 16 and s.oom_limits == (6, 1)
    out = s.schedule()  # the retry: half the tokens
    assert out.requests == [a] and out.num_scheduled_tokens == [6]


def test_three_ooms_in_a_minute_make_the_worker_unhealthy():
    h = OomHistory()
    for _ in range(OOM_LIMIT - 1):
        h.record()
    assert h.unhealthy is None
    h.times[0] -= 120  # the first one is old
    h.record()
    assert h.unhealthy is None
    h.record()
    assert "ran out of device memory" in h.unhealthy


def test_nan_logits_fail_that_request_only(tiny_llama, clean):
    eng = engine(tiny_llama, fault_injection="nan@3")
    got = run(eng, PROMPTS)
    err = got.pop("r0")  # row 0 of step 3 is r0's
    assert isinstance(err, RequestFault) and "NaN or infinite logits" in str(err)
    assert got == {k: v for k, v in clean.items() if k != "r0"}
    assert eng.stats()["num_failed_nan"] == 1


def test_nan_in_one_sibling_fails_its_n_request_and_no_other(tiny_llama, clean):
    eng = engine(tiny_llama, fault_injection="nan@3")
    eng.add_request("pair", {"prompt_token_ids": PROMPTS[3]}, SamplingParams(n=2, temperature=0, max_tokens=6))
    got = run(eng, PROMPTS[:3])  # the pair's first sibling holds row 0 of step 3: both siblings end with the error
    assert isinstance(got.pop("pair"), RequestFault) and got == {k: v for k, v in clean.items() if k != "r3"}


def test_nan_in_one_rows_step_fails_that_request_and_in_every_row_of_many_is_a_device_fault(tiny_llama, monkeypatch):
    eng = engine(tiny_llama, fault_injection="nan@2")
    eng.add_request("only", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    eng.step()
    [out] = eng.step()
    assert isinstance(out.error, RequestFault) and not eng.has_unfinished()
    runner = eng.step_runner.runner
    logits = runner.logits
    monkeypatch.setattr(runner, "logits", lambda hidden, rows: logits(hidden, rows) * float("nan"))
    for i in range(2):
        eng.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, GREEDY)
    with pytest.raises(EngineFault, match="every row"):
        eng.step()


def _stream_all(eng: AsyncEngine, n: int) -> list:
    async def one(i):
        try:
            return [o async for o in eng.generate({"prompt_token_ids": PROMPTS[i]}, GREEDY)][-1]
        except Exception as e:  # noqa: BLE001 - what the caller sees
            return e

    async def main():
        return await asyncio.gather(*(one(i) for i in range(n)))

    return asyncio.run(main())


def test_a_hung_step_fails_every_request_through_the_watchdog(tiny_llama):
    eng = AsyncEngine(engine=engine(tiny_llama, fault_injection="hang@2", step_timeout_s=1.0))
    faults = []
    eng.on_fault = faults.append
    t0 = time.monotonic()
    results = _stream_all(eng, 3)
    assert time.monotonic() - t0 < 10
    assert all(isinstance(r, EngineFault) and "STEP_TIMEOUT_S" in str(r) for r in results)
    assert len(faults) == 1 and eng.unhealthy.startswith("an engine step ran for more than 1 s")
    with pytest.raises(EngineFault):  # nothing new is taken
        asyncio.run(_first(eng))
    eng.shutdown()  # does not wait on the hung thread


async def _first(eng):
    async for o in eng.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY):
        return o


def test_a_device_error_is_a_fault_at_once(tiny_llama, monkeypatch):
    eng = AsyncEngine(engine=engine(tiny_llama))
    runner = eng.engine.step_runner.runner

    def illegal(batch):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(runner, "forward", illegal)
    faults = []
    eng.on_fault = faults.append
    results = _stream_all(eng, 2)
    assert all(isinstance(r, EngineFault) and "illegal memory access" in str(r) for r in results)
    assert len(faults) == 1 and eng.unhealthy is not None
    eng.shutdown()


def test_three_oom_steps_in_a_minute_ask_for_a_replacement_on_both_endpoint_kinds(tiny_llama):
    """The jobs are served (each OOM'd step is retried), and then the queue worker asks Runpod to replace it
    (refresh_worker) and the load-balancing health check answers 503 with the reason."""
    from fastapi.testclient import TestClient

    from handler import lb
    from handler.settings import load_settings
    from handler.worker import Worker

    eng = AsyncEngine(engine=engine(tiny_llama, fault_injection="oom@1,oom@2,oom@3"))
    settings = load_settings({"MODEL_NAME": str(tiny_llama)})
    worker = Worker(settings, eng)
    cfg = worker.runpod_config()
    job = {"prompt": "hello", "sampling_params": {"max_tokens": 5, "temperature": 0, "ignore_eos": True}}

    async def run():
        return [c async for c in worker.handle({"id": "j", "input": job})]

    chunks = asyncio.run(run())
    assert "error" not in chunks[-1] and chunks[-1]["usage"]["output"] == 5
    assert cfg.get("refresh_worker") is True and "ran out of device memory" in worker.unhealthy
    server = lb.LBServer(settings)
    server.worker, server.state = worker, "ready"
    ping = TestClient(lb._Guard(lb.create_app(server), server)).get("/ping")
    assert ping.status_code == 503 and "ran out of device memory" in ping.json()["reason"]
    eng.shutdown()
