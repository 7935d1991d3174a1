"""Smoke tests of the handler on real SmolLM2: what a scripted engine cannot show (the model's text, the prefix
cache, a tensor that once overflowed, KV freed on cancel). The handler's job logic and shapes are tested on the
scripted engine in tests/test_handler_jobs.py."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest

from engine import AsyncEngine, EngineConfig
from handler.settings import load_settings
from handler.worker import Worker
from tests.test_handler_jobs import error_of, run_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker(smollm2_path):
    # fp32: greedy text must not depend on what else is in the batch (bf16 GEMMs round differently by M)
    eng = AsyncEngine(EngineConfig(model=str(smollm2_path), dtype="float32", max_model_len=2048, log_stats_interval=0))
    yield Worker(load_settings({"MAX_CONCURRENCY": "8"}), eng)
    eng.shutdown()


def test_native_stream_batches_and_usage(worker):
    counts_only = Worker(load_settings({"STREAM_FLUSH_MS": "3600000"}), worker.engine)  # the count bound alone
    chunks = run_job(
        counts_only,
        {
            "prompt": "The capital of France is",
            "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": 20, "ignore_eos": True},
        },
    )
    sizes = [len(c["choices"][0]["tokens"]) for c in chunks]
    assert sizes[:3] == [1, 3, 9] and sum(sizes) <= 20 and len(chunks) == 4
    assert chunks[-1]["usage"] == {"input": 5, "output": 20, "cached_input": 0}
    m = chunks[-1]["metrics"]
    assert m["prompt_tokens"] == 5 and m["output_tokens"] == 20 and m["num_preemptions"] == 0
    assert 0 <= m["queue_time"] <= m["ttft"] <= m["e2e_time"] and 0 < m["mean_itl"] <= m["max_itl"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(t for c in chunks for t in c["choices"][0]["tokens"]).startswith(" Paris.")


def test_openai_chat_nonstream_and_stream_agree(worker):
    body = {"messages": [{"role": "user", "content": "What is 2+2?"}], "temperature": 0, "max_tokens": 24}
    full = run_job(worker, {"openai_route": "/v1/chat/completions", "openai_input": body})[0]
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["role"] == "assistant"
    assert full["usage"]["completion_tokens"] > 0
    streamed = run_job(
        worker,
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {**body, "stream": True, "stream_options": {"include_usage": True}},
        },
    )
    events = [e for s in streamed for e in s.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    objs = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    text = "".join(o["choices"][0]["delta"].get("content", "") for o in objs if o["choices"])
    assert text == full["choices"][0]["message"]["content"]
    u = objs[-1]["usage"]
    assert objs[-1]["choices"] == [] and {k: v for k, v in u.items() if k != "prompt_tokens_details"} == {
        k: v for k, v in full["usage"].items() if k != "prompt_tokens_details"
    }
    # the second request with this prompt finds its full blocks in the prefix cache
    assert u["prompt_tokens_details"]["cached_tokens"] == (u["prompt_tokens"] - 1) // 16 * 16 > 0
    assert objs[-2]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]


def test_edge_values_that_are_valid(worker):
    # any top_k at or past the vocabulary means "no top-k" (it once overflowed a tensor and failed the engine)
    out = run_job(worker, {"prompt": "Hi", "sampling_params": {"max_tokens": 3, "top_k": 2**63, "seed": 7}})
    assert error_of(out) is None and out[-1]["usage"]["output"] == 3
    # /v1/completions without max_tokens: 16 tokens, as OpenAI and vLLM
    out = run_job(
        worker, {"openai_route": "/v1/completions", "openai_input": {"prompt": "1, 2, 3,", "ignore_eos": True}}
    )
    assert out[-1]["usage"]["completion_tokens"] == 16
    assert worker.fault is None


def test_cancelling_the_job_task_frees_kv(worker):
    job = {
        "prompt": "Tell a long story",
        "stream": True,
        "sampling_params": {"max_tokens": 500, "ignore_eos": True, "temperature": 0},
    }

    async def go():
        got = asyncio.Event()

        async def consume():
            async for _ in worker.handle({"id": "cancel-me", "input": job}):
                got.set()

        task = asyncio.create_task(consume())  # runpod runs each job as a task and cancels it
        await asyncio.wait_for(got.wait(), 30)
        assert worker.engine.stats()["running"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return worker.engine.stats()

    st = asyncio.run(go())
    assert st["num_free_blocks"] == st["num_total_blocks"] and st["running"] == 0


def test_a_job_cancelled_while_the_sdk_sends_a_chunk_frees_every_prompts_kv(worker, caplog):
    """runpod's handle_job awaits its POST of each chunk outside our generator: a cancel there raises nothing in
    Worker.handle, which runpod's run_job_generator leaves open and the loop closes later (GeneratorExit at its
    yield, its inner generators still open). By the time the job's end is logged, every prompt of the batch must be
    aborted and its KV freed (the emulator's cancel tests read that line)."""
    from runpod.serverless.modules.rp_job import run_job_generator

    body = {"prompt": ["Tell a long story", "Count to a thousand:", "A, B, C,"], "max_tokens": 1500, "stream": True}
    job = {"id": "cancel-mid-post", "input": {"openai_route": "/v1/completions", "openai_input": body}}

    async def go():
        got = asyncio.Event()

        async def consume():  # runpod's handle_job, its stream_result POST standing still
            async for _ in run_job_generator(worker.handle, job):
                got.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got.wait(), 60)
        assert worker.engine.stats()["running"] == 3
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the loop closes the abandoned generators once nothing holds them
            await asyncio.sleep(0.05)
            if any("cancel-mid-post cancelled" in r.getMessage() for r in caplog.records):
                break

    with caplog.at_level(logging.INFO, logger="handler"):
        asyncio.run(go())
    ends = [r.getMessage() for r in caplog.records if "cancel-mid-post cancelled" in r.getMessage()]
    assert len(ends) == 1, ends
    free, total, running, waiting = re.search(r"free (\d+)/(\d+), running (\d+), waiting (\d+)", ends[0]).groups()
    assert free == total and running == waiting == "0", ends[0]
