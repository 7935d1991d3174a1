"""OpenAI's Responses API (handler/openai_responses.py) through the official `openai` SDK, unmodified, against a
load-balancing worker on SmolLM2: text, a function tool round trip, a json_schema format, the event stream as
client.responses.stream() consumes it, previous_response_id, and refusals naming the field."""

from __future__ import annotations

import json

import openai
import pytest

from bench.procs import LBWorker, emulator_env

pytestmark = pytest.mark.slow  # a worker process

MODEL = "smol"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client():
    env = emulator_env(DTYPE="bfloat16", MAX_MODEL_LEN="4096", OPENAI_SERVED_MODEL_NAME_OVERRIDE=MODEL,
                       ENABLE_AUTO_TOOL_CHOICE="true", TOOL_CALL_PARSER="hermes")  # fmt: skip
    w = LBWorker(env)
    yield openai.OpenAI(base_url=w.base_url, api_key="local", max_retries=0, timeout=120)
    w.close()


def test_text_whole_and_streamed(client):
    r = client.responses.create(model=MODEL, input="Name three colors.", max_output_tokens=16, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text and r.usage.output_tokens <= 16
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    with client.responses.stream(model=MODEL, input="Name three colors.", max_output_tokens=16, temperature=0) as s:
        events = list(s)
    kinds = [e.type for e in events]
    # the last event carries the response: response.completed, or response.incomplete at max_output_tokens (the
    # SDK's get_final_response() takes the former only, and greedy decoding may reach the limit or stop before it)
    final = events[-1].response
    assert final.status == r.status and final.output_text == r.output_text and final.id != r.id
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{final.status}"
    assert "response.output_text.delta" in kinds and kinds.count("response.output_item.done") == 1
    inst = client.responses.create(model=MODEL, input="Hi", instructions="Answer in French.", max_output_tokens=4)
    assert inst.usage.input_tokens != r.usage.input_tokens


def test_function_tool_round_trip(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", temperature=0, max_output_tokens=200)  # fmt: skip
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Tokyo")
    follow = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}]
    r2 = client.responses.create(model=MODEL, input=follow, previous_response_id=r.id, tools=[WEATHER],
                                 tool_choice="none", max_output_tokens=12)  # fmt: skip
    assert r2.output_text and r2.previous_response_id == r.id and r2.usage.input_tokens > r.usage.input_tokens
    with client.responses.stream(model=MODEL, input="Weather in Tokyo?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                 max_output_tokens=200) as s:  # fmt: skip
        kinds = [e.type for e in s]
        final = s.get_final_response()
    fc = final.output[-1]
    assert fc.type == "function_call" and json.loads(fc.arguments)["city"] in ("Paris", "Tokyo")
    assert "response.function_call_arguments.delta" in kinds


def test_json_schema_format(client):
    fmt = {"format": {"type": "json_schema", "name": "c", "schema": {"type": "object", "properties": {
        "color": {"type": "string", "enum": ["red", "blue"]}}, "required": ["color"]}}}  # fmt: skip
    r = client.responses.create(model=MODEL, input="Pick a color.", text=fmt, max_output_tokens=30)
    assert json.loads(r.output_text)["color"] in ("red", "blue")


def test_refusals_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools.0.type" and "not available" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_unknown")
    assert "resp_unknown" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_image",
                                                                                  "image_url": "x"}]}])  # fmt: skip
    assert e.value.body["param"] == "input.0.content.0"
    r = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):  # not stored: nothing to continue
        client.responses.create(model=MODEL, input="again", previous_response_id=r.id)
