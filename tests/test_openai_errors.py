"""OpenAI's error shapes through the emulator, as the real `openai` client sees them: unknown routes and methods,
invalid JSON, bad fields, failures mid-stream; and a native job's error through `runpod.Endpoint`.

The rules (docs/api.md): {"error": {"message", "type", "param", "code"}}, type invalid_request_error /
not_found_error / server_error, code a string or null (the HTTP status is only the status), param the client's
own field path (an OpenAI request's in its body, a native job's in its input)."""

from __future__ import annotations

import json
import shlex
import sys

import httpx
import openai
import pytest

from bench.procs import Emulator, emulator_env

pytestmark = pytest.mark.slow  # the real SmolLM2 behind the handler

KEYS = {"message", "type", "param", "code"}
CHAT = [{"role": "user", "content": "Count from one to twenty."}]

# The worker with one failure planted: a request with seed 4242 fails after its third engine output, while its
# stream is under way (EngineError: not the request's fault, this job only).
FAILING_WORKER = """
import sys
from engine import AsyncEngine, EngineError
generate = AsyncEngine.generate
async def failing(self, valid, params=None, request_id=None, lora=None):  # the handler passes a ValidRequest
    async for i, out in _numbered(generate(self, valid, params, request_id, lora)):
        yield out
        if valid.params.seed == 4242 and i == 2:
            raise EngineError("injected: the engine lost this request")
async def _numbered(gen):
    i = 0
    async for out in gen:
        yield i, out
        i += 1
AsyncEngine.generate = failing
from handler.__main__ import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def emu(smollm2_path):
    env = emulator_env(MODEL_NAME=str(smollm2_path), MAX_MODEL_LEN="1024", OPENAI_SERVED_MODEL_NAME_OVERRIDE="smol")
    worker = f"{shlex.quote(sys.executable)} -c {shlex.quote(FAILING_WORKER)}"
    e = Emulator(env, argv=["-m", "handler.local", "--worker-cmd", worker])
    yield e
    e.close()


@pytest.fixture(scope="module")
def oai(emu):
    return openai.OpenAI(base_url=emu.base_url, api_key="local", max_retries=0, timeout=120)


def test_unknown_routes_and_methods_answer_openais_error_object(emu, oai):
    for call, route in [
        (lambda: oai.images.generate(model="smol", prompt="hi"), "POST /v1/images/generations"),
        (lambda: oai.moderations.create(model="smol", input="hi"), "POST /v1/moderations"),
        (lambda: oai.models.retrieve("smol"), "GET /v1/models/smol"),
    ]:
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert route in e.value.message, e.value.message  # the route asked for, then the routes there are
        assert all(
            r in e.value.message for r in ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models")
        )
        assert e.value.body.keys() == KEYS and e.value.body["param"] is None
        assert (e.value.type, e.value.code) == ("not_found_error", "unknown_url")  # OpenAI's code for it
    r = httpx.get(f"{emu.base_url}/chat/completions")  # a route that exists, with the wrong method
    assert (r.status_code, r.headers["allow"]) == (405, "POST"), r.text
    err = r.json()["error"]
    assert err.keys() == KEYS and err["code"] == "method_not_allowed" and "POST /v1/chat/completions" in err["message"]


def test_invalid_json_is_a_bad_request(emu, oai):
    raw = b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}'
    r = httpx.post(f"{emu.base_url}/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err.keys() == KEYS and (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, None)
    assert "not valid JSON" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:  # the same bytes through the SDK's own raw-body call
        oai.post(
            "/chat/completions", content=raw, cast_to=object, options={"headers": {"Content-Type": "application/json"}}
        )
    assert e.value.type == "invalid_request_error" and e.value.body.keys() == KEYS


@pytest.mark.parametrize(
    "kwargs, param, code",
    [
        ({"messages": CHAT, "extra_body": {"wat": 1}}, "wat", "unknown_parameter"),
        ({"messages": CHAT, "extra_body": {"stream_options": {"wat": 1}}}, "stream_options.wat", "unknown_parameter"),
        ({"messages": CHAT, "temperature": "hot"}, "temperature", None),
        ({"messages": CHAT, "max_tokens": 10**6}, "max_tokens", "context_length_exceeded"),
        ({"messages": CHAT, "extra_body": {"response_format": {"type": "nonsense"}}}, "response_format", None),
    ],
)
def test_a_bad_field_is_named_as_the_client_wrote_it(oai, kwargs, param, code):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="smol", **kwargs)
    body = e.value.body
    assert body.keys() == KEYS and body["type"] == "invalid_request_error", body
    assert (body["param"], body["code"]) == (param, code), body
    assert "openai_input" not in body["message"] and param in body["message"], body


def _stream(oai, **kw):
    """A chat stream and its job id (the emulator's X-Job-Id header)."""
    raw = oai.chat.completions.with_raw_response.create(model="smol", messages=CHAT, stream=True, **kw)
    return raw.parse(), raw.headers["x-job-id"]


def test_a_stream_that_fails_midway_ends_with_an_error_event(emu, oai):
    stream, _ = _stream(oai, max_tokens=40, seed=4242)
    got = []
    with pytest.raises(openai.APIError) as e:
        for chunk in stream:
            got.append(chunk)
    assert got, "the failure came before the stream began"  # else it is a plain error response
    assert e.value.body.keys() == KEYS and e.value.body["type"] == "server_error", e.value.body
    assert e.value.body["code"] is None and "injected" in e.value.message
    # and raw: one error event in the same shape, then [DONE], as vLLM ends a failed stream
    body = {"model": "smol", "messages": CHAT, "stream": True, "max_tokens": 40, "seed": 4242}
    events = [
        ln for ln in httpx.post(f"{emu.base_url}/chat/completions", json=body, timeout=120).text.split("\n") if ln
    ]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"].keys() == KEYS, events[-3:]


def test_a_stream_cancelled_midway_says_so(emu, oai):
    stream, job_id = _stream(oai, max_tokens=400, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError) as e:
        for i, _ in enumerate(stream):
            if i == 1:
                httpx.post(f"{emu.base}/cancel/{job_id}")
    assert e.value.body.keys() == KEYS and e.value.body["code"] == "request_cancelled", e.value.body


def test_runpod_client_gets_a_native_jobs_error(emu):
    import runpod

    runpod.api_key = "local"
    runpod.endpoint_url_base = f"http://127.0.0.1:{emu.port}/v2"
    endpoint = runpod.Endpoint("local")
    for job, param, code in [
        ({"prompt": "x", "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens", None),
        ({"prompt": "x", "sampling_params": {"unknown_knob": 1}}, "sampling_params.unknown_knob", "unknown_parameter"),
    ]:
        run = endpoint.run(job)
        assert run.output(timeout=60) is None and run.status() == "FAILED"
        err = json.loads(httpx.get(f"{emu.base}/status/{run.job_id}").json()["error"])
        assert (err["type"], err["param"], err["code"], err["status"]) == ("invalid_request_error", param, code, 400)
    ok = endpoint.run_sync({"prompt": "hi", "sampling_params": {"max_tokens": 2}}, timeout=60)  # and it serves on
    assert ok[-1]["usage"]["output"] == 2, ok
