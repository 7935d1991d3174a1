"""Anthropic's Messages API (handler/anthropic_messages.py) through the official `anthropic` SDK, unmodified, against
load-balancing workers: SmolLM2 for text, streams, a tool round trip and token counts; a scripted tiny model
(tests/utils.py) with REASONING_PARSER for a thinking block, whole and streamed."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from bench.procs import LBWorker, emulator_env
from tests.utils import build_scripted_model

pytestmark = pytest.mark.slow  # worker processes

KEY, MODEL = "sk-ant-test", "smol"
ASK = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK no longer takes sampling fields as arguments
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
        "required": ["city"],
    },
}


def _env(**kw) -> dict:
    return emulator_env(**{"DTYPE": "bfloat16", "MAX_MODEL_LEN": "4096", "OPENAI_SERVED_MODEL_NAME_OVERRIDE": MODEL,
                           "API_KEY": KEY, **kw})  # fmt: skip


@pytest.fixture(scope="module")
def client():
    w = LBWorker(_env(ENABLE_AUTO_TOOL_CHOICE="true", TOOL_CALL_PARSER="hermes"))
    yield anthropic.Anthropic(base_url=w.api, api_key=KEY, max_retries=0, timeout=120)  # x-api-key: KEY
    w.close()


def test_create_and_stream(client):
    msg = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, **GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "text"
    assert msg.stop_reason in ("end_turn", "max_tokens") and 0 < msg.usage.output_tokens <= 16
    with client.messages.stream(model=MODEL, max_tokens=16, messages=ASK, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text and final.content[0].text == text
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == msg.usage.output_tokens
    count = client.messages.count_tokens(model=MODEL, messages=ASK)
    assert count.input_tokens == msg.usage.input_tokens
    system = client.messages.create(model=MODEL, max_tokens=4, messages=ASK, system="Answer in French.")
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, system="Answer in French.").input_tokens
    assert system.usage.input_tokens == counted != msg.usage.input_tokens  # it replaced the template's default


def test_tool_round_trip(client):
    msg = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER],
                                 tool_choice={"type": "any"}, **GREEDY)  # fmt: skip
    use = next(b for b in msg.content if b.type == "tool_use")
    assert msg.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    history = ASK + [
        {"role": "assistant", "content": msg.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}]},
    ]
    reply = client.messages.create(model=MODEL, max_tokens=12, messages=history, tools=[WEATHER], **GREEDY)
    assert reply.content and reply.content[0].type == "text" and reply.usage.input_tokens > msg.usage.input_tokens
    with client.messages.stream(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY) as s:  # fmt: skip
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert isinstance(final.content[-1].input["city"], str)


def test_errors_in_anthropics_shape(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nonexistent", max_tokens=4, messages=ASK)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    bad = anthropic.Anthropic(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    url = str(client.base_url).rstrip("/") + "/v1/messages"
    r = httpx.post(url, headers={"x-api-key": KEY}, json={"model": MODEL, "messages": ASK})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"  # max_tokens is required


def test_a_thinking_block(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}<|assistant|>"
    script = ["<think>", "Let", " me", " see", "</think>", "Blue", "!"]
    path = build_scripted_model(tmp_path / "m", script, template=template)
    w = LBWorker(_env(MODEL_NAME=str(path), DTYPE="float32", MAX_MODEL_LEN="512", REASONING_PARSER="qwen3"))
    try:
        client = anthropic.Anthropic(base_url=w.api, api_key=KEY, max_retries=0, timeout=60)
        msg = client.messages.create(model=MODEL, max_tokens=20, messages=ASK)
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert msg.content[0].thinking == "Let me see" and msg.content[1].text == "Blue!"
        with client.messages.stream(model=MODEL, max_tokens=20, messages=ASK,
                                    thinking={"type": "enabled", "budget_tokens": 16}) as s:  # fmt: skip
            kinds = [e.type for e in s]
            final = s.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "Let me see"
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds.count("content_block_stop") == 2
    finally:
        w.close()
