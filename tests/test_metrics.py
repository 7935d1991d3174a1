"""handler/metrics.py: the /metrics body under vLLM's names, read back with prometheus_client's own parser. Real
requests on a tiny model through jobs.generate (the hook every route passes through), and scripted streams with a
fake clock for what a real run cannot pin down (ITL shared over the tokens of one output, n > 1, an error output)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

import handler.metrics as metrics_mod
from engine import AsyncEngine, EngineConfig, EngineError, SamplingParams
from engine.types import CompletionOutput, RequestOutput
from handler import jobs
from handler.jobs import JobContext
from handler.metrics import Metrics
from handler.settings import load_settings

MODEL = "tiny-served"
P = list(range(10, 50))  # 40 prompt tokens: two full blocks of 16, which a repeat finds in the prefix cache


def scrape(m: Metrics) -> dict[str, float]:
    """Sample name (with its labels other than model_name and engine) -> value; every sample carries both."""
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            assert s.labels.pop("model_name") == MODEL and s.labels.pop("engine") == "0", s
            out[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def les(values: dict[str, float], hist: str) -> list[str]:
    return [k.split("{le=")[1][:-1] for k in values if k.startswith(f"{hist}_bucket")]


class StubEngine:
    """An engine's stats() with a distinct value under each key: a key read into the wrong metric shows."""

    def stats(self) -> dict:
        return {
            "running": 2,
            "waiting": 1,
            "kv_usage": 0.25,
            "prefix_cache_queried_tokens": 7,
            "prefix_cache_hit_tokens": 3,
            "num_preemptions": 4,
            "num_generated_tokens": 99,
            "num_failed_nan": 1,
            "num_oom_steps": 2,
        }


def test_engine_state_is_read_at_scrape_under_vllms_names():
    v = scrape(Metrics(StubEngine(), MODEL))
    assert v["vllm:num_requests_running"] == 2 and v["vllm:num_requests_waiting"] == 1
    assert v["vllm:kv_cache_usage_perc"] == 0.25
    assert v["vllm:prefix_cache_queries_total"] == 7 and v["vllm:prefix_cache_hits_total"] == 3
    assert v["vllm:num_preemptions_total"] == 4
    assert v["worker:num_requests_nan_logits_total"] == 1 and v["worker:num_steps_out_of_memory_total"] == 2
    for reason in ("stop", "length", "abort", "error"):  # every reason shows from the start, at 0
        assert v[f"vllm:request_success_total{{finished_reason={reason}}}"] == 0
    assert v["vllm:prompt_tokens_total"] == 0 and v["vllm:generation_tokens_total"] == 0
    # vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), written out here: a change to the module's shows
    ttft = (
        "0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 40.0 80.0 160.0 640.0 2560.0"
    )
    itl = "0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 40.0 80.0"
    e2e = "0.3 0.5 0.8 1.0 1.5 2.0 2.5 5.0 10.0 15.0 20.0 30.0 40.0 50.0 60.0 120.0 240.0 480.0 960.0 1920.0 7680.0"
    assert les(v, "vllm:time_to_first_token_seconds") == ttft.split() + ["+Inf"]
    assert les(v, "vllm:inter_token_latency_seconds") == itl.split() + ["+Inf"]
    assert les(v, "vllm:e2e_request_latency_seconds") == e2e.split() + ["+Inf"]
    Metrics(StubEngine(), MODEL)  # a second worker in this process: its own registry, no duplicate


def out(tokens: list[list[int]], reasons=None, error=None) -> RequestOutput:
    """One step's output: the new tokens of each sequence, finished when reasons are given."""
    reasons = reasons or [None] * len(tokens)
    seqs = [
        CompletionOutput(i, "", t, finish_reason=r, delta_token_ids=t) for i, (t, r) in enumerate(zip(tokens, reasons))
    ]
    return RequestOutput("x", [1, 2, 3], seqs, finished=reasons[0] is not None, error=error)


def test_watch_shares_a_gap_over_its_tokens_and_labels_the_end(monkeypatch):
    clock = iter([0.0, 1.0, 1.75, 2.25, 10.0] + [20.0, 21.0, 21.5, 23.0] + [30.0, 31.0, 32.0])
    monkeypatch.setattr(metrics_mod, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    m = Metrics(StubEngine(), MODEL)

    async def stream(outs):
        for o in outs:
            yield o

    async def go():
        # start 0; first token at 1; 3 tokens (speculation) at 1.75: 0.25 s each; one at 2.25; a finished output
        # with an error (a failed adapter) and no tokens; the end at 10
        one = [out([[5]]), out([[6, 7, 8]]), out([[9]]), out([[]], ["abort"], RuntimeError("adapter"))]
        assert [o async for o in m.watch(stream(one))] == one
        # n=2 from 20: both first tokens at 21, then 2 + 1 tokens at 21.5 (ITL 0.25 twice, 0.5 once), one stops
        # and one hits its length; the end at 23
        two = [out([[5], [6]]), out([[7, 8], [9]], ["stop", "length"])]
        assert [o async for o in m.watch(stream(two))] == two
        # closed by its consumer after its first token (30 -> 31): an abort, counted at once; the end at 32
        w = m.watch(stream([out([[5]]), out([[6]])]))
        await anext(w)
        await w.aclose()

    asyncio.run(go())
    v = scrape(m)
    assert v["vllm:request_success_total{finished_reason=error}"] == 1
    assert v["vllm:request_success_total{finished_reason=length}"] == 1
    assert v["vllm:request_success_total{finished_reason=abort}"] == 1
    assert v["vllm:request_success_total{finished_reason=stop}"] == 0
    assert v["vllm:prompt_tokens_total"] == 9 and v["vllm:generation_tokens_total"] == 5 + 5 + 1
    assert v["vllm:time_to_first_token_seconds_count"] == 3 and v["vllm:time_to_first_token_seconds_sum"] == 3.0
    assert v["vllm:inter_token_latency_seconds_count"] == 4 + 3  # one per token after the first ones
    assert v["vllm:inter_token_latency_seconds_sum"] == 0.75 + 0.5 + 0.5 + 0.5
    assert v["vllm:inter_token_latency_seconds_bucket{le=0.2}"] == 0
    assert v["vllm:inter_token_latency_seconds_bucket{le=0.3}"] == 5  # the three shares of 0.75 and two of 0.5
    assert v["vllm:inter_token_latency_seconds_bucket{le=0.4}"] == 5
    assert v["vllm:inter_token_latency_seconds_bucket{le=0.5}"] == 7
    assert v["vllm:e2e_request_latency_seconds_count"] == 3
    assert v["vllm:e2e_request_latency_seconds_sum"] == 10 + 3 + 2


def test_a_cancelled_request_is_an_abort():
    """How a paced stream ends a job (handler/pacing.py): its pending pull is cancelled inside the stream."""
    m = Metrics(StubEngine(), MODEL)

    async def stalled():
        yield out([[5]])
        await asyncio.Event().wait()

    async def go():
        w = m.watch(stalled())
        await anext(w)
        pull = asyncio.ensure_future(anext(w))
        await asyncio.sleep(0)
        pull.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pull

    asyncio.run(go())
    v = scrape(m)
    assert v["vllm:request_success_total{finished_reason=abort}"] == 1
    assert v["vllm:request_success_total{finished_reason=error}"] == 0
    assert v["vllm:e2e_request_latency_seconds_count"] == 1 and v["vllm:time_to_first_token_seconds_count"] == 1


def test_real_requests_through_jobs_generate(tiny_llama):
    """Two length-limited requests (the second finds the first's prompt in the prefix cache), one stopped by a
    stop token, one closed midway, and one the engine refuses (its id is the open one's)."""
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=0))
    m = Metrics(engine, MODEL)
    ctx = JobContext(engine, load_settings({}), MODEL, metrics=m)

    def valid(**kw):
        return engine.validate({"prompt_token_ids": P}, SamplingParams(temperature=0, **kw))

    async def run(v, rid):
        return [o async for o in jobs.generate(ctx, v, rid)]

    async def go():
        first = await run(valid(max_tokens=6, ignore_eos=True), "r1")
        hits_before = scrape(m)["vllm:prefix_cache_hits_total"]
        again = await run(valid(max_tokens=6, ignore_eos=True), "r2")
        stop_at = first[-1].outputs[0].token_ids[2]
        stopped = await run(valid(max_tokens=6, ignore_eos=True, stop_token_ids=[stop_at]), "r3")
        long = jobs.generate(ctx, valid(max_tokens=400, ignore_eos=True), "r4")
        held = [await anext(long) for _ in range(3)]
        during = scrape(m)
        with pytest.raises(EngineError, match="already in use"):
            await run(valid(max_tokens=6), "r4")
        await long.aclose()  # the stream's finalizers end the request: wait for the engine to free it
        deadline = time.monotonic() + 10
        while (
            scrape(m)["vllm:num_requests_running"] or not scrape(m)["vllm:request_success_total{finished_reason=abort}"]
        ):
            assert time.monotonic() < deadline, scrape(m)
            await asyncio.sleep(0.01)
        return [first, again, stopped, held], hits_before, during

    try:
        produced, hits_before, during = asyncio.run(go())
        stats = engine.stats()
    finally:
        engine.shutdown()
    first, again, stopped, held = produced
    assert [first[-1].outputs[0].finish_reason, again[-1].outputs[0].finish_reason] == ["length", "length"]
    assert stopped[-1].outputs[0].finish_reason == "stop" and not held[-1].finished
    generated = sum(len(c.delta_token_ids) for outs in produced for o in outs for c in o.outputs)
    assert generated == 6 + 6 + len(stopped[-1].outputs[0].token_ids) + 3

    v = scrape(m)
    assert {
        r: v[f"vllm:request_success_total{{finished_reason={r}}}"] for r in ("stop", "length", "abort", "error")
    } == {
        "stop": 1,
        "length": 2,
        "abort": 1,
        "error": 1,
    }
    assert v["vllm:prompt_tokens_total"] == 4 * len(P)  # the refused request made no token: no prompt counted
    assert v["vllm:generation_tokens_total"] == generated
    assert v["vllm:time_to_first_token_seconds_count"] == 4
    assert v["vllm:inter_token_latency_seconds_count"] == generated - 4
    assert v["vllm:e2e_request_latency_seconds_count"] == 5
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert v[f"vllm:{h}_bucket{{le=+Inf}}"] == v[f"vllm:{h}_count"]
    assert 0 < v["vllm:time_to_first_token_seconds_sum"] < v["vllm:e2e_request_latency_seconds_sum"]
    assert 0 < v["vllm:inter_token_latency_seconds_sum"] < v["vllm:e2e_request_latency_seconds_sum"]
    # the engine's state: live while a request runs, settled at the end, and its totals as the engine counts them
    assert during["vllm:num_requests_running"] == 1 and 0 < during["vllm:kv_cache_usage_perc"] <= 1
    assert v["vllm:num_requests_running"] == 0 and v["vllm:num_requests_waiting"] == 0
    assert 0 <= v["vllm:kv_cache_usage_perc"] <= 1 and v["vllm:kv_cache_usage_perc"] == stats["kv_usage"]
    assert hits_before == 0 and v["vllm:prefix_cache_hits_total"] >= 2 * 16
    assert v["vllm:prefix_cache_hits_total"] == stats["prefix_cache_hit_tokens"]
    assert v["vllm:prefix_cache_queries_total"] == stats["prefix_cache_queried_tokens"] >= 4 * len(P)
    assert v["vllm:num_preemptions_total"] == 0
