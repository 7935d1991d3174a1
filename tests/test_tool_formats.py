"""TOOL_CALL_PARSER's formats (handler/tool_formats.py): each parsed whole, a character a delta, and cut at every
pair of points, where the streamed deltas must join into the whole response's content and calls, with arguments
that are valid JSON; then through the real Worker and engine, on tiny models built to write each format (the
mistral one with [TOOL_CALLS] as a special token, which the parser keeps by decoding with skip_special_tokens
false)."""

from __future__ import annotations

import json
import typing

import pytest

from engine import AsyncEngine, EngineConfig
from handler.settings import Settings, load_settings
from handler.tool_calls import ToolCallStream, history
from handler.tool_formats import PARSERS
from handler.worker import Worker
from tests.test_handler_jobs import run_job
from tests.test_tool_calls import feed_all
from tests.utils import build_scripted_model

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "hours": {"type": "array"},
            "scale": {"type": "number"},
            "note": {"type": ["string", "null"]},
        },
    },
    "noop": {"type": "object", "properties": {}},
}
PARIS = {"city": "Paris"}
CASES = [  # (format, text, content, [(name, arguments)])
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "noop"}]',
     "Sure.", [("get_weather", PARIS), ("noop", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]noop[ARGS]{}',
     None, [("get_weather", {"city": "Paris", "days": 2}), ("noop", {})]),
    ("mistral", "No tools [TOOL", "No tools [TOOL", []),
    ("pythonic", '[get_weather(city="Paris", days=2, metric=True, hours=[1, 2]), noop()]',
     None, [("get_weather", {"city": "Paris", "days": 2, "metric": True, "hours": [1, 2]}), ("noop", {})]),
    ("pythonic", "<|python_start|>[get_weather(city='a)b\\'c')]<|python_end|>", None,
     [("get_weather", {"city": "a)b'c"})]),
    ("llama4_pythonic", "[Paris](https://en.wikipedia.org/wiki/Paris) is a city.",
     "[Paris](https://en.wikipedia.org/wiki/Paris) is a city.", []),
    ("pythonic", "[1, 2]", "[1, 2]", []),
    ("pythonic", "Paris.", "Paris.", []),
    ("qwen3_coder",
     "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, France\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nFalse\n</parameter>\n<parameter=hours>\n[1, 2]\n"
     "</parameter>\n<parameter=scale>\n2.5\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=noop>\n</function>\n</tool_call>",
     "Let me check.",
     [("get_weather", {"city": "Paris, France", "days": 3, "metric": False, "hours": [1, 2], "scale": 2.5,
                       "note": None}), ("noop", {})]),
    ("qwen3_xml", "<function=get_weather>\n<parameter=city>\nParis\n<parameter=unknown>\n{x}\n</function>",
     None, [("get_weather", {"city": "Paris", "unknown": "{x}"})]),  # unclosed parameters, as vLLM takes them
    ("qwen3_coder", "a <tool and <func", "a <tool and <func", []),
    ("hermes", '<tool_call>{"name": "noop"}</tool_call>', None, [("noop", {})]),
]  # fmt: skip


def _run(fmt: str, pieces: list[str]):
    st = ToolCallStream(f"auto:{fmt}", schemas=SCHEMAS)
    content, joined = feed_all(st, pieces)
    message = st.message()
    assert joined == [(c["function"]["name"], c["function"]["arguments"]) for c in message[1]]
    assert (content.strip() or None) == message[0]
    return message[0], [(name, json.loads(args)) for name, args in joined]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_whole_streamed_and_cut_everywhere(fmt, text, content, calls):
    assert _run(fmt, [text]) == (content, calls)
    assert _run(fmt, list(text)) == (content, calls)
    step = max(1, len(text) // 40)  # every pair of cuts on short texts; a comb on long ones
    for i in range(0, len(text) + 1, step):
        for j in range(i, len(text) + 1, step):
            assert _run(fmt, [text[:i], text[i:j], text[j:]]) == (content, calls), (i, j)


def test_one_call_when_parallel_calls_are_off():
    text = "[TOOL_CALLS]get_weather[ARGS]{}[TOOL_CALLS]noop[ARGS]{}"
    st = ToolCallStream("auto:mistral", max_calls=1)
    st.feed(text)
    assert [c["function"]["name"] for c in st.message()[1]] == ["get_weather"]
    st = ToolCallStream("auto:pythonic", max_calls=1)
    st.feed("[get_weather(city='x'), noop()]")
    assert [c["function"]["name"] for c in st.message()[1]] == ["get_weather"]


def test_mistral_call_ids_are_nine_letters_and_digits():
    st = ToolCallStream("auto:mistral")
    st.feed('[TOOL_CALLS][{"name": "noop", "arguments": {}}]')
    ids = [c["id"] for c in st.message()[1]]
    assert len(ids) == 1 and len(ids[0]) == 9 and ids[0].isalnum()


def test_history_in_each_format_for_a_template_without_tool_calls():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    for fmt in PARSERS:  # written back as the model writes it, it parses to the same call
        text = history(msgs, fmt, "{{ m }}")[0]["content"]
        assert _run(fmt, [text]) == (None, [("get_weather", PARIS)]), fmt


def test_every_parser_is_a_setting():
    """Every text format is a setting; `openai` too, GPT-OSS's harmony calls (handler/harmony.py parses them)."""
    field = Settings.model_fields["TOOL_CALL_PARSER"].annotation
    assert set(typing.get_args(typing.get_args(field)[0])) == set(PARSERS) | {"openai"}


# ---- through the worker ------------------------------------------------------------------------------------------
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}<|assistant|>"
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
SCRIPTS = {  # format: (the model's pieces, its special tokens)
    "mistral": (["Sure", ".", "[TOOL_CALLS]", "get_weather", "[ARGS]", '{"city": ', '"Paris"}'],
                ("[TOOL_CALLS]", "[ARGS]")),
    "pythonic": (["[get_weather(", 'city="Paris"', ")]"], ()),
    "qwen3_coder": (["Sure.", "<tool_call>", "\n<function=get_weather>\n", "<parameter=city>\n", "Paris",
                     "\n</parameter>\n", "</function>\n", "</tool_call>"], ()),
}  # fmt: skip


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    out = {}
    for fmt, (script, special) in SCRIPTS.items():
        path = build_scripted_model(root / fmt, script, template=TEMPLATE, special=special)
        out[fmt] = AsyncEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0))
    yield out
    for e in out.values():
        e.shutdown()


def _chat(worker, stream: bool):
    inp = {"openai_route": "/v1/chat/completions",
           "openai_input": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
                            "stream": stream, "max_tokens": 20, "temperature": 0}}  # fmt: skip
    chunks = run_job(worker, inp)
    if not stream:
        (whole,) = chunks
        choice = whole["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
        return choice["message"]["content"], calls, choice["finish_reason"]
    events = [json.loads(e[6:]) for c in chunks for e in c.split("\n\n") if e.startswith("data: {")]
    deltas = [e["choices"][0] for e in events if e.get("choices")]
    content = "".join(d["delta"].get("content") or "" for d in deltas) or None
    calls = {}
    for t in (t for d in deltas for t in d["delta"].get("tool_calls") or ()):
        name, args = calls.get(t["index"], (t["function"].get("name"), ""))
        calls[t["index"]] = (name, args + t["function"]["arguments"])
    return content, [calls[i] for i in sorted(calls)], next(d["finish_reason"] for d in deltas if d["finish_reason"])


@pytest.mark.parametrize("fmt", list(SCRIPTS))
def test_a_call_in_each_format_whole_and_streamed(engines, fmt):
    worker = Worker(load_settings({"ENABLE_AUTO_TOOL_CHOICE": "true", "TOOL_CALL_PARSER": fmt}), engines[fmt])
    for stream in (False, True):
        content, calls, finish = _chat(worker, stream)
        assert content == (None if fmt == "pythonic" else "Sure."), (fmt, stream)
        assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", PARIS)] and finish == "tool_calls"
    # without a parser the reply is the model's text, its special tokens dropped as usual
    script, special = SCRIPTS[fmt]
    plain = run_job(Worker(load_settings({}), engines[fmt]), {"openai_route": "/v1/chat/completions", "openai_input": {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 20, "temperature": 0}})[0]  # fmt: skip
    assert plain["choices"][0]["message"]["content"] == "".join(p for p in script if p not in special).strip()


def test_the_stop_token_has_no_text_with_special_tokens_kept(engines):
    """skip_special_tokens false keeps [TOOL_CALLS] in the text but not the EOS that ended the reply (vLLM's rule:
    the token that stopped a sequence shows only with include_stop_str_in_output)."""
    worker = Worker(load_settings({}), engines["mistral"])
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 20, "temperature": 0,
            "skip_special_tokens": False}  # fmt: skip
    text = run_job(worker, {"openai_route": "/v1/chat/completions", "openai_input": body})[0]
    assert text["choices"][0]["message"]["content"].endswith('[ARGS]{"city": "Paris"}')
    body["include_stop_str_in_output"] = True
    text = run_job(worker, {"openai_route": "/v1/chat/completions", "openai_input": body})[0]
    eos = engines["mistral"].tok.decode([engines["mistral"].tok.eos_token_id], skip_special_tokens=False)
    assert eos and text["choices"][0]["message"]["content"].endswith('"Paris"}' + eos)
