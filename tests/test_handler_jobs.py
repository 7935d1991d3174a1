"""The handler's job logic, called as runpod calls it (an async generator per job), on a scripted engine
(tests/fakes.py: the real tokenizer and validation, no model). What needs the model itself is in
tests/test_handler_smoke.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from handler.settings import load_settings
from handler.worker import Worker
from tests.fakes import FakeAsyncEngine


@pytest.fixture(scope="module")
def worker(smollm2_path):
    # SmolLM2's tokenizer and limits; the scripted model answers " Paris. ..." to every prompt
    return Worker(load_settings({"MAX_CONCURRENCY": "8"}), FakeAsyncEngine(smollm2_path, max_model_len=2048))


def run_job(worker, inp) -> list:
    async def go():
        return [c async for c in worker.handle({"id": "t", "input": inp})]

    return asyncio.run(go())


def error_of(chunks) -> dict | None:
    if len(chunks) == 1 and isinstance(chunks[0], dict) and "error" in chunks[0]:
        return json.loads(chunks[0]["error"])
    return None


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


def test_streams_flush_on_time_native_and_openai(worker):
    """With a 1 ms flush interval nearly every engine step is its own yield (count alone: 1, 3, 9, 17 tokens in
    4 yields), and the streamed text is the same as unstreamed."""
    fast = Worker(load_settings({"STREAM_FLUSH_MS": "1"}), worker.engine)
    sp = {"temperature": 0, "max_tokens": 30, "ignore_eos": True}
    chunks = run_job(fast, {"prompt": "The capital of France is", "stream": True, "sampling_params": sp})
    whole = run_job(fast, {"prompt": "The capital of France is", "sampling_params": sp})
    assert len(chunks) > 10 and all(c["choices"][0]["tokens"] for c in chunks[:-1])
    assert "".join(t for c in chunks for t in c["choices"][0]["tokens"]) == "".join(whole[0]["choices"][0]["tokens"])
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 30,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sse = run_job(fast, {"openai_route": "/v1/completions", "openai_input": body})
    assert len(sse) > 10 and sse[-1].endswith("data: [DONE]\n\n")
    texts = [json.loads(e[6:])["choices"][0]["text"] for s in sse for e in s.split("\n\n") if e.startswith("data: {")]
    assert "".join(texts) == "".join(whole[0]["choices"][0]["tokens"])


def test_native_default_max_tokens_is_stated(worker):
    chunks = run_job(worker, {"prompt": "Count: 1, 2, 3,", "sampling_params": {"temperature": 0, "ignore_eos": True}})
    assert len(chunks) == 1  # not streamed: one yield
    assert chunks[0]["usage"]["output"] == 100 and chunks[0]["max_tokens"] == 100 and "default" in chunks[0]["note"]


def test_native_messages_and_n(worker):
    chunks = run_job(
        worker,
        {
            "messages": [{"role": "user", "content": "Say hi"}],
            "sampling_params": {"n": 2, "temperature": 0.8, "seed": 1, "max_tokens": 8},
        },
    )
    assert len(chunks[0]["choices"]) == 2


def test_openai_completions_logprobs_and_models(worker):
    out = run_job(
        worker,
        {
            "openai_route": "/v1/completions",
            "openai_input": {
                "prompt": "Hello",
                "max_tokens": 5,
                "temperature": 0,
                "logprobs": 2,
                "top_k": 5,
                "ignore_eos": True,
            },
        },
    )[0]
    lp = out["choices"][0]["logprobs"]
    assert out["object"] == "text_completion" and len(lp["tokens"]) == 5 and len(lp["top_logprobs"][0]) >= 2
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    chat = run_job(
        worker,
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "logprobs": True,
                "top_logprobs": 2,
            },
        },
    )[0]
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and len(content[0]["top_logprobs"]) == 2 and content[0]["logprob"] <= 0
    models = run_job(worker, {"openai_route": "/v1/models"})[0]
    assert models["data"][0]["id"] == worker.served_name


BAD_JOBS = [
    ({"prompt": "x", "bogus": 1}, "bogus"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),
    ("not an object", "input"),
    (None, "input"),
    ({"prompt": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"prompt": "x", "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
    ({"prompt": "x", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"prompt": "x", "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
    ({"prompt": "x", "sampling_params": {"max_tokens": "many"}}, "sampling_params.max_tokens"),
    ({"prompt": "x", "sampling_params": {"top_k": -5}}, "sampling_params.top_k"),
    ({"prompt": "x", "sampling_params": {"logprobs": 99}}, "sampling_params.logprobs"),
    ({"prompt": "x", "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
    ({"prompt": "x", "sampling_params": {"frequency_penalty": 5}}, "sampling_params.frequency_penalty"),
    ({"prompt": "x", "sampling_params": {"unknown_knob": 1}}, "sampling_params.unknown_knob"),
    ({"prompt": "x", "sampling_params": []}, "sampling_params"),
    ({"prompt": "x", "max_batch_size": 0}, "max_batch_size"),
    ({"prompt": "x", "sampling_params": {"max_tokens": 10**6}}, "sampling_params.max_tokens"),
    ({"prompt": "x", "stream": "yes please"}, "stream"),
    ({"prompt": "word " * 3000}, "prompt"),  # longer than max_model_len
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages.0.content"),
    ({"openai_route": "/v1/moderations", "openai_input": {}}, "/v1/moderations"),  # the route, named
    ({"openai_route": "/v1/chat/completions", "openai_input": {"messages": []}}, "messages"),
    (
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"},
        },
        "model",
    ),
    (
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9},
        },
        "max_tokens",
    ),
    (
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {"messages": [{"role": "user", "content": "x"}], "wat": True},
        },
        "wat",
    ),
    (
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        },
        "tools",
    ),
    (
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}},
        },
        "logit_bias.abc",
    ),
    (
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50},
        },
        "top_logprobs",
    ),
    ({"openai_route": "/v1/completions", "openai_input": {"prompt": ["a", ""]}}, "prompt"),  # a batch: one empty
    ({"openai_route": "/v1/completions", "openai_input": {"prompt": [[1, 2], [3, "a"]]}}, "prompt"),
    ({"openai_route": "/v1/completions", "openai_input": {"prompt": [1, 2, 10**7]}}, "prompt_token_ids"),
    (
        {"openai_route": "/v1/completions", "openai_input": {"prompt": "x", "temperature": "hot"}},
        "temperature",
    ),
    ({"openai_route": "/v1/completions", "openai_input": "x"}, "the request body"),
    # found by probing a running worker: each of these once failed the engine for every job, hung it, or
    # escaped as a raw traceback
    (
        {"prompt": "x", "sampling_params": {"min_tokens": 1, "stop_token_ids": [60000]}},
        "sampling_params.stop_token_ids",
    ),
    ({"prompt": "x", "sampling_params": {"n": 20000}}, "sampling_params.n"),
    ({"prompt": "x", "sampling_params": {"seed": 2**64}}, "sampling_params.seed"),
    ({"prompt": "bad \ud800 surrogate"}, "prompt"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    (
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}},
        },
        "chat_template_kwargs.messages",
    ),
    (
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        },
        "top_logprobs",
    ),
    (
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
        },
        "tool_choice",
    ),
    ({"openai_route": "/v1/completions", "openai_input": {"prompt": "x", "max_tokens": 0}}, "max_tokens"),
    ({"openai_route": "/v1/completions", "openai_input": {"prompt": "x", "n": 10**6}}, "n"),
]


def test_bad_jobs_get_clear_errors_while_good_jobs_run(worker):
    good = {"prompt": "Once upon a time", "sampling_params": {"temperature": 0, "max_tokens": 40, "ignore_eos": True}}
    solo = run_job(worker, good)

    async def go():
        async def one(inp):
            return [c async for c in worker.handle({"id": "j", "input": inp})]

        return await asyncio.gather(*(one(good) for _ in range(3)), *(one(inp) for inp, _ in BAD_JOBS))

    results = asyncio.run(go())

    def untimed(chunks):
        return [{k: v for k, v in c.items() if k != "metrics"} for c in chunks]

    for r in results[:3]:
        assert untimed(r) == untimed(solo)  # good jobs unaffected
    assert len(BAD_JOBS) >= 30
    for (inp, param), chunks in zip(BAD_JOBS, results[3:]):
        err = error_of(chunks)
        assert err is not None, f"{inp!r} was accepted: {chunks}"
        assert err["message"] and err["type"] and 400 <= err["status"] < 600
        assert param in (err["param"] or "") or param in err["message"], (inp, err)
        # OpenAI's rules: a string code or none; paths as the client wrote them (an OpenAI job's: in its body)
        assert err["code"] is None or isinstance(err["code"], str), (inp, err)
        assert "openai_input" not in f"{err['param']} {err['message']}", (inp, err)
    assert worker.fault is None


def test_error_params_are_field_paths(worker):
    err = error_of(run_job(worker, {"prompt": "x", "sampling_params": {"stop": 5}}))
    assert err["param"] == "sampling_params.stop"  # not pydantic's union member ("...stop.str")
    err = error_of(run_job(worker, {"openai_route": "/v1/completions", "openai_input": {"prompt": [1, 10**7]}}))
    assert err["param"] == "prompt"
    # an OpenAI job's params are paths in its body; a native job's (use_openai_format too) paths in its input
    chat = {"messages": [{"role": "user", "content": "x"}]}
    err = error_of(run_job(worker, {"openai_route": "/v1/chat/completions", "openai_input": chat | {"wat": 1}}))
    assert (err["param"], err["code"], err["status"]) == ("wat", "unknown_parameter", 400)
    assert err["message"].startswith("wat: unknown field"), err
    err = error_of(run_job(worker, {"use_openai_format": True, **chat, "sampling_params": {"max_tokens": 10**6}}))
    assert (err["param"], err["code"]) == ("sampling_params.max_tokens", "context_length_exceeded"), err
    err = error_of(run_job(worker, {"openai_route": "/v1/moderations", "openai_input": {}}))
    assert (err["type"], err["code"], err["status"], err["param"]) == ("not_found_error", "unknown_url", 404, None)
    assert "/v1/moderations" in err["message"] and "POST /v1/chat/completions" in err["message"], err


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
        lambda kids: (
            st.lists(kids, max_size=3)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "prompt",
                        "messages",
                        "sampling_params",
                        "stream",
                        "max_tokens",
                        "n",
                        "openai_route",
                        "openai_input",
                        "temperature",
                        "role",
                        "content",
                        "x",
                    ]
                ),
                kids,
                max_size=4,
            )
        ),
        max_leaves=8,
    )
)
def test_random_json_never_crashes_the_schema(data):
    from handler.schemas import ChatCompletionRequest, JobError, NativeJob, parse

    for model in (NativeJob, ChatCompletionRequest):
        try:
            parse(model, data)
        except JobError as e:
            assert e.message


_NEW_ROUTES = ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize"]
_NEW_ROUTES += ["/v1/embeddings"]
_KEYS = ["input", "messages", "model", "max_tokens", "max_output_tokens", "tools", "tool_choice", "system", "role"]
_KEYS += ["content", "type", "text", "stream", "prompt", "tokens", "call_id", "previous_response_id", "thinking"]
_KEYS += ["dimensions", "encoding_format", "truncate_prompt_tokens", "normalize"]


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.sampled_from(_NEW_ROUTES),
    st.recursive(
        st.none() | st.booleans() | st.integers(-3, 70000) | st.text(max_size=6) | st.sampled_from(["user", "text"]),
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), kids, max_size=4),
        max_leaves=10,
    ),
)
def test_random_bodies_on_the_newer_routes_get_answers_or_field_errors(worker, route, body):
    """Responses, Anthropic Messages, (de)tokenize and embeddings: any JSON gets an answer or an error object, never a
    crash."""
    chunks = run_job(worker, {"openai_route": route, "openai_input": body})
    assert chunks
    err = error_of(chunks)
    if err is not None:
        assert err["message"] and not err["message"].startswith("internal error"), (route, body, err)
