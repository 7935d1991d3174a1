"""handler/tool_calls.py without a model: what each tool_choice plans, and the output parser, fed whole and one
character at a time (a stream's deltas must reassemble into the whole response's calls and content)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from handler.schemas import JobError
from handler.tool_calls import ToolCallStream, history, plan

TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}
ON = SimpleNamespace(ENABLE_AUTO_TOOL_CHOICE=True, TOOL_CALL_PARSER="hermes")
OFF = SimpleNamespace(ENABLE_AUTO_TOOL_CHOICE=False, TOOL_CALL_PARSER=None)


def test_plans():
    assert plan(None, None, OFF) == (None, None, None)
    assert plan([TOOL], "none", OFF) == (None, None, None)
    assert plan([TOOL], None, ON)[0] == "auto:hermes"  # tools without tool_choice: auto, as OpenAI
    mode, _, grammar = plan([TOOL], "required", OFF)
    assert mode == "required" and grammar.json["type"] == "array" and grammar.field == "openai_input.tool_choice"
    mode, name, grammar = plan([TOOL], {"type": "function", "function": {"name": "f"}}, OFF)
    assert (mode, name, grammar.json) == ("named", "f", TOOL["function"]["parameters"])
    for tools, choice, settings, why in [
        ([TOOL], "auto", OFF, "ENABLE_AUTO_TOOL_CHOICE"),
        ([TOOL], None, OFF, "ENABLE_AUTO_TOOL_CHOICE"),
        (None, "required", ON, "needs tools"),
        ([TOOL], {"type": "function", "function": {"name": "g"}}, ON, "not among the tools"),
        ([{"type": "function"}], "required", ON, "each tool"),
    ]:
        with pytest.raises(JobError, match=why) as e:
            plan(tools, choice, settings)
        assert e.value.param.startswith("openai_input.tool")


def _stream(mode, text, name=None):
    return feed_all(ToolCallStream(mode, name), text)


def feed_all(st: ToolCallStream, pieces) -> tuple[str, list[tuple[str, str]]]:
    """Feed `pieces` one by one; (the content streamed, [(name, arguments joined)] per call index)."""
    content, calls = "", {}
    for ch in pieces:
        c, deltas = st.feed(ch)
        content += c
        for d in deltas:
            e = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                assert e["name"] is None and d["type"] == "function"
                e["name"] = d["function"]["name"]
            e["arguments"] += d["function"]["arguments"]
    content += st.pending_content()
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize(
    "mode, text, name, content, calls",
    [
        (
            "required",
            '[{"name":"f","arguments":{"a":1,"b":[1,"]"]}},{"name":"g","arguments":{}}]',
            None,
            None,
            [("f", '{"a":1,"b":[1,"]"]}'), ("g", "{}")],
        ),
        ("named", '{"a":2}', "f", None, [("f", '{"a":2}')]),
        (
            "auto:hermes",
            'On it.<tool_call>\n{"name": "f", "arguments": {"a": "}{"}}\n</tool_call>',
            None,
            "On it.",
            [("f", '{"a": "}{"}')],
        ),
        ("auto:hermes", "plain text, a < sign and <tool", None, "plain text, a < sign and <tool", []),
        (
            "auto:llama3_json",
            '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
            None,
            None,
            [("f", '{"a": 1}'), ("g", "{}")],
        ),
        ("auto:llama3_json", "Hello {x}", None, "Hello {x}", []),
    ],
)
def test_stream_equals_whole(mode, text, name, content, calls):
    whole = ToolCallStream(mode, name)
    whole.feed(text)
    whole.pending_content()
    got_content, got_calls = whole.message()
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    streamed_content, streamed_calls = _stream(mode, text, name)
    assert streamed_calls == calls
    assert (streamed_content.strip() or None) == content


def test_history_for_a_template_without_tool_calls():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    msgs = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    plain = history(msgs, "hermes", "{{ message['content'] }}")
    assert "tool_calls" not in plain[0] and json.loads(plain[0]["content"].split("\n")[1]) == {
        "name": "f",
        "arguments": {"a": 1},
    }
    aware = history(msgs, "hermes", "{% for c in message.tool_calls %}{% endfor %}")
    assert aware[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_parallel_tool_calls_false_allows_one_call():
    """parallel_tool_calls false: the required grammar asks for exactly one call, and the parser keeps the first
    call of an output that makes more (vLLM's rule for auto), streamed or whole."""
    assert "maxItems" not in plan([TOOL], "required", OFF)[2].json
    assert plan([TOOL], "required", OFF, parallel=False)[2].json["maxItems"] == 1
    two = {
        "required": '[{"name":"f","arguments":{"a":1}},{"name":"g","arguments":{}}]',
        "auto:llama3_json": '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
        "auto:hermes": 'x<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g"}',
    }
    for mode, text in two.items():
        whole = ToolCallStream(mode, None, max_calls=1)
        whole.feed(text)
        whole.pending_content()
        assert [c["function"]["name"] for c in whole.message()[1]] == ["f"], mode
        st, names = ToolCallStream(mode, None, max_calls=1), []
        for ch in text:
            names += [d["function"]["name"] for d in st.feed(ch)[1] if "id" in d]
        assert names == ["f"], mode
        assert len(ToolCallStream(mode).feed(text)[1]) > 2  # without the limit: both calls
