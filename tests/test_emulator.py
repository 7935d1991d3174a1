"""End to end over real HTTP: `python -m handler.local` runs the real worker (runpod's JobScaler) on SmolLM2,
and the official `openai` client and `runpod.Endpoint` talk to it unmodified."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
import requests

from bench.procs import Emulator, emulator_env

pytestmark = pytest.mark.slow  # the emulator and the worker as processes, on the real SmolLM2

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def emu(smollm2_path):
    env = emulator_env(
        MODEL_NAME=str(smollm2_path),
        DTYPE="float32",
        MAX_CONCURRENCY="8",
        MAX_MODEL_LEN="2048",
        OPENAI_SERVED_MODEL_NAME_OVERRIDE="smol",
    )
    e = Emulator(env)
    yield e
    e.close()


@pytest.fixture(scope="module")
def oai(emu):
    from openai import OpenAI

    return OpenAI(base_url=f"{emu.base}/openai/v1", api_key="local", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def endpoint(emu):
    import runpod

    runpod.api_key = "local"
    runpod.endpoint_url_base = f"http://127.0.0.1:{emu.port}/v2"
    return runpod.Endpoint("local")


CHAT = [{"role": "user", "content": "Name three colors."}]


def test_openai_client(oai):
    assert [m.id for m in oai.models.list().data] == ["smol"]
    full = oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert text and full.usage.completion_tokens > 0
    stream = oai.chat.completions.create(
        model="smol", messages=CHAT, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == text and usage.completion_tokens == full.usage.completion_tokens
    # the same prompt again: its full 16-token blocks come from the prefix cache
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached == (usage.prompt_tokens - 1) // 16 * 16 > 0
    comp = oai.completions.create(
        model="smol",
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        extra_body={"top_k": 1, "ignore_eos": True},
    )
    assert comp.choices[0].text.startswith(" Paris")
    from openai import NotFoundError

    with pytest.raises(NotFoundError):
        oai.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)


def test_runpod_endpoint(endpoint):
    job = {
        "prompt": "The capital of France is",
        "stream": True,
        "sampling_params": {"temperature": 0, "max_tokens": 12, "ignore_eos": True},
    }
    out = endpoint.run_sync(job, timeout=120)
    text = "".join(t for c in out for t in c["choices"][0]["tokens"])
    assert text.startswith(" Paris") and out[-1]["usage"]["output"] == 12
    run = endpoint.run(job)
    streamed = "".join(t for c in run.stream() for t in c["choices"][0]["tokens"])
    assert streamed == text and run.status() == "COMPLETED"


def _native_text(chunks):
    return "".join(t for c in chunks for t in c["choices"][0]["tokens"])


def test_32_concurrent_mixed_jobs(emu, oai):
    kinds = [
        ("native", "Write one sentence about the sea."),
        ("native", "List two animals:"),
        ("openai", "Say hello in French."),
        ("openai", "What is 3+3?"),
    ]

    def native(prompt):
        r = requests.post(
            f"{emu.base}/run",
            json={"input": {"prompt": prompt, "stream": True, "sampling_params": {"temperature": 0, "max_tokens": 24}}},
        ).json()
        t0, first, chunks = time.time(), None, []
        while True:
            s = requests.get(f"{emu.base}/stream/{r['id']}", timeout=60).json()
            if s.get("stream") and first is None:
                first = time.time() - t0
            chunks += [x["output"] for x in s.get("stream", [])]
            if s["status"] in ("COMPLETED", "FAILED", "CANCELLED"):
                assert s["status"] == "COMPLETED", s
                return _native_text(chunks), first, time.time() - t0

    def openai(prompt):
        t0, first, text = time.time(), None, ""
        for chunk in oai.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0, stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.time() - t0
                text += chunk.choices[0].delta.content
        return text, first, time.time() - t0

    run = {"native": native, "openai": openai}
    solo = {k: run[k[0]](k[1])[0] for k in kinds}

    async def all32():
        return await asyncio.gather(*(asyncio.to_thread(run[k[0]], k[1]) for k in kinds * 8))

    results = asyncio.run(all32())
    for k, (text, first, total) in zip(kinds * 8, results):
        assert text == solo[k], k
        assert first is not None and first < total  # the first chunk arrived before the job ended
    peak = max(int(m) for m in re.findall(r"max so far: (\d+)", "\n".join(emu.lines)))
    assert 1 < peak <= 8, peak


def test_cancel_frees_kv_blocks(emu):
    r = requests.post(
        f"{emu.base}/run",
        json={
            "input": {
                "prompt": "Tell me a very long story.",
                "stream": True,
                "sampling_params": {"max_tokens": 1500, "ignore_eos": True},
            }
        },
    ).json()
    while not requests.get(f"{emu.base}/stream/{r['id']}", timeout=60).json().get("stream"):
        pass
    assert requests.post(f"{emu.base}/cancel/{r['id']}").json()["status"] == "CANCELLED"
    m = emu.wait_for(rf"job {r['id']} cancelled .*KV blocks free (\d+)/(\d+), running (\d+)", 30)
    assert m.group(1) == m.group(2) and m.group(3) == "0"
    assert requests.get(f"{emu.base}/status/{r['id']}").json()["status"] == "CANCELLED"


def test_non_json_numbers_and_lone_surrogates_are_refused_at_the_door(emu):
    """NaN, Infinity, 1e400 and "\\ud800" parse in Python but cannot be sent on to the worker: they used to be
    queued, then break the job-take that carried them (and lose the good jobs in the same batch)."""
    bodies = [
        '{"input": {"prompt": "hi", "sampling_params": {"temperature": NaN}}}',
        '{"input": {"prompt": "hi", "sampling_params": {"temperature": 1e400}}}',
        '{"input": {"prompt": "bad \\ud800"}}',
    ]
    for body in bodies:
        r = requests.post(f"{emu.base}/run", data=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"], (body, r.text)
    r = requests.post(
        f"{emu.base}/openai/v1/chat/completions",
        data='{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    # and the queue still serves
    ok = requests.post(
        f"{emu.base}/runsync", json={"input": {"prompt": "hi", "sampling_params": {"max_tokens": 2}}}, timeout=120
    ).json()
    assert ok["status"] == "COMPLETED", ok


def test_a_worker_with_an_invalid_setting_takes_jobs_and_fails_each_naming_it():
    """Through runpod's real loop: not "no job" and an exit (the webhook was once lost with the invalid settings),
    which Runpod answers by starting the worker again and again while the callers' jobs wait."""
    with Emulator(emulator_env(MAX_MODEL_LEN="lots")) as e:
        out = requests.post(f"{e.api}/runsync", json={"input": {"prompt": "hi"}}, timeout=60).json()
        assert out["status"] == "FAILED" and "MAX_MODEL_LEN='lots'" in out["error"], out
        assert e.proc.poll() is None  # still serving
        e.wait_for("queue endpoint mode: RUNPOD_WEBHOOK_GET_JOB is set", 1)
