"""The local emulator's load-balancing endpoint (handler/local_lb.py) through real processes: `python -m handler.local
--lb --workers 2` routes to two real workers (`python -m handler`, RUNPOD_ENDPOINT_TYPE=lb) on the embedded SmolLM2,
and the `openai` client and httpx talk to it."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import sys
import time

import httpx
import pytest

from bench.procs import Emulator, emulator_env

pytestmark = pytest.mark.slow  # the router and its workers as processes, on the real SmolLM2

MODEL = "smol"
W0, W1 = "local-lb-worker-0", "local-lb-worker-1"
HEADER = "X-Runpod-Worker-Id"
SYSTEM = " ".join(f"Rule {i}: answer politely, briefly and mention the color number {i * 7 % 13}." for i in range(70))
LONG = {"max_tokens": 1500, "ignore_eos": True}  # a stream that outlasts the test's use of it


class LBEmulator(Emulator):
    """`python -m handler.local --lb --workers N ...`: the router at `api`, the OpenAI routes at `base_url`.
    ready=True: return once /health shows all N workers ready."""

    def __init__(self, *args: str, env: dict | None = None, workers: int = 2, ready: bool = True, **popen):
        argv = ["-m", "handler.local", "--lb", "--workers", str(workers), *args]
        super().__init__(env, argv=argv, wait=False, start_new_session=True, **popen)
        self.api = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.api}/v1"
        self.wait_health(workers if ready else 0)

    def health(self) -> dict:
        return httpx.get(f"{self.api}/health", timeout=10).json()

    def wait_health(self, ready: int, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if (h := self.health())["workers"]["ready"] >= ready:
                    return h
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"the router's workers did not become ready:\n{self.tail(40)}")

    def stop_and_check_nothing_is_left(self, timeout: float = 30) -> None:
        pids = [w["pid"] for w in self.health()["localWorkers"]]
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout)
        for group in [self.proc.pid, *pids]:  # the router's session, and each worker's own
            with pytest.raises(ProcessLookupError):
                os.killpg(group, 0)
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def _env(**kw) -> dict:
    return emulator_env(DTYPE="bfloat16", MAX_MODEL_LEN="4096", OPENAI_SERVED_MODEL_NAME_OVERRIDE=MODEL, **kw)


@pytest.fixture(scope="module")
def lb():
    # two slots per worker and no waiting room: a third request is the worker's 429
    e = LBEmulator("--strict-wait", "3", env=_env(MAX_CONCURRENCY="2", LB_MAX_WAITING="0"))
    yield e
    e.close()


def _oai(e: LBEmulator, aio: bool = False):
    from openai import AsyncOpenAI, OpenAI

    return (AsyncOpenAI if aio else OpenAI)(base_url=e.base_url, api_key="local", max_retries=0, timeout=120)


def _chat(text: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0, **kw}


def _in_flight(e: LBEmulator) -> dict[str, int]:
    return {w["id"]: w["inFlight"] for w in e.health()["localWorkers"]}


def _running(e: LBEmulator, worker: str) -> float:
    """The worker's own count of running requests (its /metrics, reached with strict affinity)."""
    text = httpx.get(f"{e.api}/metrics", headers={HEADER: f"strict {worker}"}, timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))


def _settles(check, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "did not settle"
        time.sleep(0.1)


async def _open(client: httpx.AsyncClient, e: LBEmulator, worker: str | None = None, **kw) -> httpx.Response:
    """A long chat stream, its first event read: it holds one of its worker's slots until closed."""
    headers = {HEADER: f"strict {worker}"} if worker else {}
    body = _chat("Count to a thousand.", stream=True, **{**LONG, **kw})
    r = await client.send(client.build_request("POST", f"{e.base_url}/chat/completions", json=body, headers=headers),
                          stream=True)  # fmt: skip
    assert r.status_code == 200, await r.aread()
    r.lines = r.aiter_lines()  # kept: a dropped iterator would close the stream
    await r.lines.__anext__()
    return r


def test_streams_spread_over_both_workers_token_by_token_and_a_client_that_leaves_frees_its_worker(lb):
    async def main():
        oai = _oai(lb, aio=True)

        async def one():
            raw = await oai.chat.completions.with_raw_response.create(
                messages=[{"role": "user", "content": "Name three colors."}], model=MODEL, stream=True, extra_body=LONG
            )
            stream = raw.parse()
            pieces = []
            async for chunk in stream:  # token by token: each event as the worker sends it
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                if len(pieces) == 8:
                    break
            return raw.headers[HEADER], stream

        opened = await asyncio.gather(*(one() for _ in range(4)))
        flight = await asyncio.to_thread(_in_flight, lb)
        for _, stream in opened:
            await stream.close()  # the client leaves mid-stream
        return collections.Counter(w for w, _ in opened), flight

    t0 = time.monotonic()
    placed, flight = asyncio.run(main())
    assert placed == {W0: 2, W1: 2}  # the least busy worker each time
    assert flight == {W0: 2, W1: 2}
    # the router closed the workers' responses: they stop generating (1,500 tokens would take far longer)
    _settles(lambda: _in_flight(lb) == {W0: 0, W1: 0})
    _settles(lambda: _running(lb, W0) == _running(lb, W1) == 0)
    # a whole (non-streamed) completion is answered at its end: a client that leaves before then frees it too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{lb.base_url}/chat/completions", json=_chat("Count.", **LONG), timeout=2)
    _settles(lambda: _in_flight(lb) == {W0: 0, W1: 0})
    _settles(lambda: _running(lb, W0) == _running(lb, W1) == 0)
    assert time.monotonic() - t0 < 30


def test_affinity_pins_a_conversation_to_the_worker_with_its_prefix_cache(lb):
    oai = _oai(lb)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is rule 3?"}]
    raw = oai.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    home, reply = raw.headers[HEADER], raw.parse()
    assert home in (W0, W1) and reply.usage.prompt_tokens > 900
    other = W1 if home == W0 else W0
    for turn, affinity in enumerate([f"strict {home}", f"strict {home}", home, f"strict-resume {home}"], 2):
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And rule {turn * 5}?"}]  # fmt: skip
        raw = oai.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_headers={HEADER: affinity}
        )
        reply = raw.parse()
        assert raw.headers[HEADER] == home, (turn, affinity)
        assert reply.usage.prompt_tokens_details.cached_tokens > 900, (turn, reply.usage)
    # the other worker has never seen the conversation: no prefix to reuse there
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_headers={HEADER: f"strict {other}"}
    )
    assert raw.headers[HEADER] == other and raw.parse().usage.prompt_tokens_details.cached_tokens == 0


def test_strict_affinity_to_a_worker_that_does_not_exist_is_404(lb):
    r = httpx.post(f"{lb.base_url}/chat/completions", json=_chat("hi", max_tokens=2),
                   headers={HEADER: "strict local-lb-worker-9"})  # fmt: skip
    assert r.status_code == 404 and r.json() == {"error": "affinity_worker_gone"}


def test_full_workers_429_soft_affinity_falls_back_and_strict_affinity_waits(lb):
    short = _chat("hi", max_tokens=2)

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            chat = f"{lb.base_url}/chat/completions"
            w0 = [await _open(c, lb, W0) for _ in range(2)]  # W0 full
            soft = await c.post(chat, json=short, headers={HEADER: W0})
            t = time.monotonic()
            strict = await c.post(chat, json=short, headers={HEADER: f"strict {W0}"})
            waited = time.monotonic() - t
            w1 = [await _open(c, lb, W1) for _ in range(2)]  # both full
            normal = await c.post(chat, json=short)
            soft_both = await c.post(chat, json=short, headers={HEADER: W1})
            for r in w0 + w1:
                await r.aclose()
            t = time.monotonic()
            freed = await c.post(chat, json=short, headers={HEADER: f"strict {W0}"})
            return soft, strict, waited, normal, soft_both, freed, time.monotonic() - t

    soft, strict, waited, normal, soft_both, freed, freed_s = asyncio.run(main())
    assert soft.status_code == 200 and soft.headers[HEADER] == W1  # W0 was full: the other worker
    assert strict.status_code == 400 and strict.json() == {"error": "timed out waiting for worker"}
    assert strict.headers[HEADER] == W0 and 3 <= waited < 8  # --strict-wait 3
    for r in (normal, soft_both):  # the worker's own 429, passed through
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
        assert r.headers[HEADER] in (W0, W1) and r.json()["error"]["code"] == "worker_busy"
    assert freed.status_code == 200 and freed.headers[HEADER] == W0 and freed_s < 3  # the closed streams' slots
    answers = lb.health()["requests"]["answers"]
    assert answers["429"] >= 2 and answers["400"] >= 1


def test_no_ready_worker_is_503_after_worker_wait_and_a_worker_that_ignores_sigterm_is_killed():
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    cmd = f"{sys.executable} -c '{stubborn}'"
    e = LBEmulator("--worker-cmd", cmd, "--worker-wait", "1", "--grace", "1", env=_env(), workers=1, ready=False)
    try:
        _settles(lambda: e.health()["localWorkers"][0]["pid"] is not None)
        t = time.monotonic()
        r = httpx.get(f"{e.base_url}/models", timeout=30)
        assert r.status_code == 503 and r.json() == {"error": "no workers available"}
        assert 1 <= time.monotonic() - t < 5
        assert e.health()["workers"]["initializing"] == 1  # it never answers its /ping
        e.stop_and_check_nothing_is_left()
        assert any("SIGKILL" in line for line in e.lines), e.tail()
    finally:
        e.close()


def test_sigterm_to_the_router_leaves_no_process_behind(lb):
    t = time.monotonic()
    lb.stop_and_check_nothing_is_left()
    assert time.monotonic() - t < 15
