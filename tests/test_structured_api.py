"""Structured output and tool calling end to end: the real worker behind the local emulator on SmolLM2, driven by the
official `openai` client (and a native job over HTTP). Schemas validate with jsonschema, streams equal whole
responses, bad schemas get a 400 naming the field, tool calls follow their tool's schema and reassemble from
stream deltas, a follow-up turn with the tool's result runs, a hermes call the model writes itself is parsed under
tool_choice "auto", and /v1/completions echo returns prompt logprobs."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import requests

from bench.procs import Emulator, emulator_env
from tests.test_structured import SCHEMAS

pytestmark = pytest.mark.slow  # the real SmolLM2 behind the handler, with grammars compiled


@pytest.fixture(scope="module")
def emu(smollm2_path):
    env = emulator_env(
        MODEL_NAME=str(smollm2_path),
        DTYPE="float32",  # streams equal whole responses even when batch neighbours differ (bf16 ties can flip)
        MAX_CONCURRENCY="16",
        MAX_MODEL_LEN="2048",
        OPENAI_SERVED_MODEL_NAME_OVERRIDE="smol",
        ENABLE_AUTO_TOOL_CHOICE="true",
        TOOL_CALL_PARSER="hermes",
    )
    e = Emulator(env)
    yield e
    e.close()


@pytest.fixture(scope="module")
def oai(emu):
    return openai.OpenAI(base_url=f"{emu.base}/openai/v1", api_key="local", max_retries=0, timeout=300)


def ask(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON only: {what}"}]


def fmt(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def test_schemas_validate_and_streams_equal_whole_responses(oai):
    def one(name):
        kw = dict(model="smol", messages=ask(f"a {name} example"), temperature=0, max_tokens=150)
        full = oai.chat.completions.create(response_format=fmt(name), **kw)
        parts = [
            ch.choices[0].delta.content or ""
            for ch in oai.chat.completions.create(response_format=fmt(name), stream=True, **kw)
            if ch.choices
        ]
        return name, full.choices[0].message.content, "".join(parts), full.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, SCHEMAS))
    assert len(results) >= 10
    for name, text, streamed, finish in results:
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        assert streamed == text, name


def test_json_object_regex_and_choice(oai):
    kw = dict(model="smol", temperature=0, max_tokens=40)
    obj = oai.chat.completions.create(
        messages=ask('an object whose key "ok" is true'), response_format={"type": "json_object"}, **kw
    )
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    rx = oai.chat.completions.create(
        messages=ask("a code"), extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-\d{2}"}}, **kw
    )
    import re

    assert re.fullmatch(r"[A-Z]{3}-\d{2}", rx.choices[0].message.content)
    ch = oai.completions.create(prompt="Is the sky blue? Answer:", extra_body={"guided_choice": [" yes", " no"]}, **kw)
    assert ch.choices[0].text in (" yes", " no")


def test_bad_schema_is_a_400_naming_the_field_and_others_run_on(oai):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}

    def bad_one():
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="smol", messages=ask("x"), response_format=bad, max_tokens=10)
        return e.value

    def good_one():
        r = oai.chat.completions.create(
            model="smol", messages=ask("a color"), response_format=fmt("enum"), max_tokens=30, temperature=0
        )
        return json.loads(r.choices[0].message.content)

    with ThreadPoolExecutor(4) as pool:
        bads = [pool.submit(bad_one) for _ in range(2)]
        goods = [pool.submit(good_one) for _ in range(2)]
        for f in bads:
            assert f.result().body["param"].startswith("response_format"), f.result().body  # the client's own path
        for f in goods:
            assert f.result()["color"] in ("red", "green", "blue")
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        oai.chat.completions.create(model="smol", messages=ask("x"), extra_body={"structured_outputs": {"regex": "("}})


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 10}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def _reassemble(stream) -> tuple[list[dict], str | None]:
    calls, finish = {}, None
    for ch in stream:
        if not ch.choices:
            continue
        c = ch.choices[0]
        finish = c.finish_reason or finish
        for d in c.delta.tool_calls or []:
            e = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:  # the first delta of a call carries id, type and name
                assert d.type == "function" and d.function.name and e["id"] is None
                e["id"], e["name"] = d.id, d.function.name
            e["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls(oai, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model="smol", messages=Q, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0, max_tokens=80)
    full = oai.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in msg.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if choice == "named":
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    streamed, finish = _reassemble(oai.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in msg.tool_calls
    ]
    # the follow-up turn: the assistant's calls and the tool's result render through the template and run
    call = msg.tool_calls[0]
    follow = Q + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    answer = oai.chat.completions.create(
        model="smol", messages=follow, tools=[WEATHER, TIME], tool_choice="none", max_tokens=30
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # cut off inside the call: "length", not "tool_calls", whole and streamed
    short = kw | {"max_tokens": 6}
    assert oai.chat.completions.create(**short).choices[0].finish_reason == "length"
    assert _reassemble(oai.chat.completions.create(stream=True, **short))[1] == "length"


def test_auto_tool_choice_and_its_errors(oai):
    """Auto on an answer without a call (SmolLM2 greedy talks about Paris for all 40 tokens): the whole text is
    content, exactly what tool_choice "none" (no parsing) returns, with no tool_calls and finish_reason "length"."""
    kw = dict(model="smol", messages=Q, tools=[WEATHER], max_tokens=40, temperature=0)
    c = oai.chat.completions.create(**kw).choices[0]
    plain = oai.chat.completions.create(tool_choice="none", **kw).choices[0]
    assert c.message.content == plain.message.content and "<tool_call>" not in c.message.content
    assert not c.message.tool_calls and (c.finish_reason, plain.finish_reason) == ("length", "length")
    with pytest.raises(openai.BadRequestError, match="tool_choice") as e:
        oai.chat.completions.create(
            model="smol", messages=Q, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    assert e.value.body["param"].startswith("tool_choice"), e.value.body


def _weather_call(city: str) -> dict:
    args = json.dumps({"city": city, "unit": "celsius"})
    return {"id": f"call_{city}", "type": "function", "function": {"name": "get_weather", "arguments": args}}


# two turns in which the assistant answered with a get_weather call, then a question about another city: SmolLM2's
# chat template knows no tools, so the earlier calls reach it as hermes text (tool_calls.history), and greedy
# SmolLM2 (fp32) answers in that format itself, with the new city
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [_weather_call("Paris")]},
    {"role": "user", "content": "What is the weather in London?"},
    {"role": "assistant", "content": None, "tool_calls": [_weather_call("London")]},
    {"role": "user", "content": "What is the weather in Rome?"},
]


def test_auto_tool_call_parsed_from_the_models_own_output(oai):
    """tool_choice "auto" (ENABLE_AUTO_TOOL_CHOICE, TOOL_CALL_PARSER=hermes; no grammar): the model writes
    <tool_call>{...}</tool_call> itself, as tool_choice "none" shows, and the response carries that call parsed,
    whole and streamed."""
    kw = dict(model="smol", messages=FEW_SHOT, tools=[WEATHER, TIME], temperature=0, max_tokens=60)
    raw = oai.chat.completions.create(tool_choice="none", **kw).choices[0]  # the model's text, unparsed
    assert raw.message.content.startswith("<tool_call>") and not raw.message.tool_calls
    full = oai.chat.completions.create(tool_choice="auto", **kw).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content is None
    [call] = full.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome", "unit": "celsius"}
    assert call.function.arguments in raw.message.content  # the arguments are the model's own text
    streamed, finish = _reassemble(oai.chat.completions.create(tool_choice="auto", stream=True, **kw))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [("get_weather", call.function.arguments)]


def test_native_job_guided_json_and_completions_echo(emu, oai):
    schema = SCHEMAS["person"]
    r = requests.post(
        f"{emu.base}/runsync",
        json={
            "input": {
                "messages": ask("a person"),
                "sampling_params": {"temperature": 0, "max_tokens": 60, "guided_json": schema, "prompt_logprobs": 1},
            }
        },
        timeout=300,
    ).json()
    out = r["output"][0]
    jsonschema.validate(json.loads("".join(out["choices"][0]["tokens"])), schema)
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == out["usage"]["input"]
    # lm-eval-harness's loglikelihood request: echo, logprobs, one token
    comp = oai.completions.create(
        model="smol", prompt="The capital of France is Paris", echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    lp = comp.choices[0].logprobs
    assert comp.choices[0].text.startswith("The capital of France is Paris")
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens).startswith("The capital of France is Paris") and len(lp.tokens) == len(lp.token_logprobs)
