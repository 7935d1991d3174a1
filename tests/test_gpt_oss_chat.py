"""GPT-OSS's chat replies through the real worker and engine: a tiny GPT-OSS checkpoint with the real o200k_harmony
vocabulary writes a scripted harmony reply (tests/harmony_fixtures.py), and the chat route returns its channels as
vLLM does: `final` as content, `analysis` as reasoning, a `functions.*` call as tool_calls, whole and streamed."""

from __future__ import annotations

import json

import pytest

from engine import AsyncEngine, EngineConfig
from handler.harmony import encoding
from handler.settings import load_settings
from handler.worker import Worker
from tests.harmony_fixtures import build_scripted_gpt_oss, harmony_tokenizer
from tests.test_reasoning import _chat

pytestmark = pytest.mark.slow  # three engines over a 201k-token vocabulary

SCRIPTS = {
    "answer": "<|channel|>final<|message|>Blue is the colour!<|return|>",
    "thinking": "<|channel|>analysis<|message|>The user wants a colour; pick one.<|end|><|return|>",
    "call": ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss-chat")
    enc = encoding(str(root / "cache"))
    harmony_tokenizer(root / "tokenizer", enc, root / "cache")
    engines = {}
    for name, script in SCRIPTS.items():
        path = build_scripted_gpt_oss(root / name, enc, root / "tokenizer", script)
        engines[name] = AsyncEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                                 log_stats_interval=0, cache_root=str(root / "cache")))  # fmt: skip
    settings = load_settings({"BASE_PATH": str(root / "cache")})
    yield {name: Worker(settings, e) for name, e in engines.items()}
    for e in engines.values():
        e.shutdown()


def test_the_final_channel_is_the_content(workers):
    m = _chat(workers["answer"])["choices"][0]["message"]
    assert m["content"] == "Blue is the colour!" and m["reasoning"] is None
    r, _, c, _, deltas = _chat(workers["answer"], stream=True)
    assert (r, c) == (None, "Blue is the colour!")
    assert not any("<|" in (d.get("content") or "") for d in deltas)


def test_the_analysis_channel_is_the_reasoning(workers):
    msg = _chat(workers["thinking"], reasoning_effort="high", return_token_ids=True)
    enc = workers["thinking"].ctx.engine.tok
    assert "Reasoning: high" in enc.decode(msg["prompt_token_ids"])  # openai-harmony rendered the request
    m = msg["choices"][0]["message"]
    assert (m["reasoning"], m["content"]) == ("The user wants a colour; pick one.", None)
    assert msg["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    r, rc, c, usage, _ = _chat(workers["thinking"], stream=True, stream_options={"include_usage": True})
    assert r == rc == "The user wants a colour; pick one." and c is None


def test_a_function_call_is_a_tool_call(workers):
    choice = _chat(workers["call"], tools=[TOOL])["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    r, _, c, _, deltas = _chat(workers["call"], stream=True, tools=[TOOL])
    parts = [p for d in deltas for p in d.get("tool_calls") or ()]
    assert parts[0]["function"] == {"name": "get_weather", "arguments": ""} and parts[0]["id"].startswith("chatcmpl")
    assert json.loads("".join(p["function"]["arguments"] for p in parts[1:])) == {"city": "Paris"}


def test_forcing_a_call_is_refused_naming_the_field(workers):
    from tests.test_handler_jobs import error_of, run_job

    inp = {"openai_route": "/v1/chat/completions",
           "openai_input": {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
                            "tool_choice": "required"}}  # fmt: skip
    err = error_of(run_job(workers["call"], inp))
    assert err is not None and "tool_choice" in err["message"], err


def test_the_responses_api_carries_the_channels(workers):
    """The Responses API, which GPT-OSS recipes use: its reasoning item and its function_call item."""
    from tests.test_handler_jobs import run_job

    def respond(worker, **body):
        inp = {"openai_route": "/v1/responses", "openai_input": {"input": "Which colour?", **body}}
        (out,) = run_job(worker, inp)
        return out["output"]

    (item,) = respond(workers["thinking"], reasoning={"effort": "high"})
    assert item["type"] == "reasoning" and item["content"][0]["text"] == "The user wants a colour; pick one."
    (call,) = respond(workers["call"], tools=[{"type": "function", "name": "get_weather",
                                               "parameters": {"type": "object"}}])  # fmt: skip
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}


def test_structured_output_constrains_the_answer_not_the_channel_header(workers):
    """A grammar starts after `<|channel|>final<|message|>` (vLLM's openai_gptoss reasoning end): the model writes
    its header freely, and the answer that follows is the schema's, parsed as the final channel's content."""
    worker = workers["answer"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r, _, c, _, deltas = _chat(worker, stream=True, max_tokens=12, response_format=fmt)
    assert c is not None and c.startswith("{") and '"a"' in c, c  # the grammar's, not the script's "Blue is..."
    assert "Blue" not in c and "<|" not in c
    assert len([d for d in deltas if d.get("content")]) > 1  # streamed from the final channel as it came
