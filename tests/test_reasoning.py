"""REASONING_PARSER (handler/reasoning.py): the splitter at every split of its markers, then whole and streamed chat
completions through the real Worker and engine, on a tiny model built to write a chosen think block
(tests/utils.py build_scripted_model)."""

from __future__ import annotations

import json

import pytest

from engine import AsyncEngine, EngineConfig
from handler.reasoning import ReasoningStream, starts_in_content
from handler.settings import load_settings
from handler.worker import Worker
from tests.test_handler_jobs import run_job
from tests.utils import build_scripted_model

CASES = [  # (text, starts in content, reasoning, answer)
    ("<think>Let me see</think>\n\nBlue!", False, "Let me see", "\n\nBlue!"),
    ("Let me see</think>Blue", False, "Let me see", "Blue"),  # the template opened the block
    ("cut off while thinking", False, "cut off while thinking", None),
    ("a<think>b</think>c", False, "a<think>b", "c"),  # a <think> after text is text
    ("\n<think>x</think>y", False, "\nx", "y"),
    ("ends in a partial </thi", False, "ends in a partial </thi", None),
    ("<thin", False, "<thin", None),
    ("</think>all answer", False, None, "all answer"),
    ("<think>ignored</think>answer", True, None, "<think>ignored</think>answer"),  # thinking is off
]


def _feed(pieces: list[str], in_content: bool):
    st, r, c = ReasoningStream(in_content), "", ""
    for p in pieces:
        dr, dc = st.feed(p, tokens=1)
        r, c = r + dr, c + dc
    r += st.finish()[0]
    assert (r or None, c or None) == st.split()  # what was streamed is what a whole reply says
    return r or None, c or None, st.reasoning_tokens


@pytest.mark.parametrize("text, in_content, reasoning, answer", CASES)
def test_every_split_gives_the_same_reasoning_and_answer(text, in_content, reasoning, answer):
    assert _feed([text], in_content)[:2] == (reasoning, answer)
    assert _feed(list(text), in_content)[:2] == (reasoning, answer)  # a character a delta
    for i in range(len(text) + 1):  # two deltas, cut everywhere (inside the markers too)
        for j in range(i, len(text) + 1):
            assert _feed([text[:i], text[i:j], text[j:]], in_content)[:2] == (reasoning, answer), (i, j)


def test_reasoning_tokens_count_until_the_block_ends():
    text = "<think>ab</think>cd"
    assert _feed(list(text), False)[2] == len("<think>ab</think>")  # a token a character here
    assert _feed(list(text), True)[2] == 0


def test_where_a_reply_starts():
    assert not starts_in_content("qwen3", "user: hi<|im_start|>assistant\n", None)
    assert starts_in_content("qwen3", "assistant\n<think>\n\n</think>\n\n", None)  # the template closed it
    assert not starts_in_content("qwen3", "assistant\n<think>\n", None)
    assert starts_in_content("qwen3", "assistant\n", {"enable_thinking": False})
    assert not starts_in_content("deepseek_r1", "assistant\n", {"enable_thinking": False})  # qwen3's switch only


# ---- through the worker ------------------------------------------------------------------------------------------
THINK = ["<think>", "Let", " me", " see", "</", "thi", "nk>", "\n\n", "Blue", "!"]  # "</think>" in three tokens
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}<|assistant|>"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = ["<think>", "Need", " a", " tool", "</think>", "<tool_call>",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}', "</tool_call>"]  # fmt: skip


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    out = {}
    for name, script in (("think", THINK), ("call", CALL)):
        path = build_scripted_model(root / name, script, template=TEMPLATE)
        out[name] = AsyncEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0))
    yield out
    for e in out.values():
        e.shutdown()


def _chat(worker, stream=False, **body):
    inp = {"openai_route": "/v1/chat/completions",
           "openai_input": {"messages": [{"role": "user", "content": "Which colour?"}], "stream": stream,
                            "max_tokens": 40, "temperature": 0, **body}}  # fmt: skip
    chunks = run_job(worker, inp)
    if not stream:
        assert len(chunks) == 1, chunks
        return chunks[0]
    events = [json.loads(e[6:]) for c in chunks for e in c.split("\n\n") if e.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    usage = next((e["usage"] for e in events if e.get("usage")), None)
    join = lambda k: "".join(d.get(k) or "" for d in deltas) or None  # noqa: E731
    return join("reasoning"), join("reasoning_content"), join("content"), usage, deltas


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_whole_and_streamed(engines, parser):
    worker = Worker(load_settings({"REASONING_PARSER": parser}), engines["think"])
    msg = _chat(worker)
    m, usage = msg["choices"][0]["message"], msg["usage"]
    assert (m["reasoning"], m["reasoning_content"], m["content"]) == ("Let me see", "Let me see", "\n\nBlue!")
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 7  # <think> Let me see </ thi nk>
    r, rc, c, usage, deltas = _chat(worker, stream=True, stream_options={"include_usage": True})
    assert (r, rc, c) == ("Let me see", "Let me see", "\n\nBlue!")
    assert not any("think" in (d.get("content") or "") + (d.get("reasoning") or "") for d in deltas)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 7
    # without a parser: the think block is the answer's text, as before
    plain = _chat(Worker(load_settings({}), engines["think"]))["choices"][0]["message"]
    assert plain["content"] == "<think>Let me see</think>\n\nBlue!" and "reasoning" not in plain


def test_thinking_turned_off_is_all_answer(engines):
    worker = Worker(load_settings({"REASONING_PARSER": "qwen3"}), engines["think"])
    msg = _chat(worker, chat_template_kwargs={"enable_thinking": False})
    m = msg["choices"][0]["message"]
    assert m["reasoning"] is None and m["content"] == "<think>Let me see</think>\n\nBlue!"
    assert msg["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_max_tokens_counts_the_reasoning(engines):
    worker = Worker(load_settings({"REASONING_PARSER": "qwen3"}), engines["think"])
    msg = _chat(worker, max_tokens=3)
    m = msg["choices"][0]
    assert m["message"]["reasoning"] == "Let me" and m["message"]["content"] is None and m["finish_reason"] == "length"


def test_a_tool_call_after_the_reasoning(engines):
    settings = {"REASONING_PARSER": "qwen3", "ENABLE_AUTO_TOOL_CHOICE": "true", "TOOL_CALL_PARSER": "hermes"}
    worker = Worker(load_settings(settings), engines["call"])
    choice = _chat(worker, tools=[TOOL])["choices"][0]
    m = choice["message"]
    assert m["reasoning"] == "Need a tool" and choice["finish_reason"] == "tool_calls"
    call = m["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    r, _, c, _, deltas = _chat(worker, stream=True, tools=[TOOL], stream_options={"include_usage": True})
    assert r == "Need a tool" and not (c or "").strip()
    args = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls") or [])
    assert json.loads(args) == {"city": "Paris"}


def test_a_grammar_constrains_the_answer_not_the_thinking(engines):
    """The JSON schema is enforced after </think>: the think block is written as the model wants, then the answer
    is what the schema allows (the scripted model wanted "\\n\\nBlue!"). Without a parser the grammar holds from the
    first token, and there is no think block."""
    schema = {"type": "string", "enum": ["red", "green"]}
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}
    worker = Worker(load_settings({"REASONING_PARSER": "qwen3"}), engines["think"])
    m = _chat(worker, **fmt)["choices"][0]["message"]
    assert m["reasoning"] == "Let me see" and json.loads(m["content"]) in ("red", "green")
    r, _, c, _, _ = _chat(worker, stream=True, **fmt)
    assert r == "Let me see" and json.loads(c) in ("red", "green")
    plain = _chat(Worker(load_settings({}), engines["think"]), **fmt)["choices"][0]["message"]
    assert json.loads(plain["content"]) in ("red", "green")  # no think block: the grammar held from the start
    off = _chat(worker, chat_template_kwargs={"enable_thinking": False}, **fmt)["choices"][0]["message"]
    assert off["reasoning"] is None and json.loads(off["content"]) in ("red", "green")


def test_reasoning_items_in_the_responses_api(engines):
    worker = Worker(load_settings({"REASONING_PARSER": "qwen3"}), engines["think"])
    body = {"input": "Which colour?", "max_output_tokens": 40, "temperature": 0}
    whole = run_job(worker, {"openai_route": "/v1/responses", "openai_input": body})[0]
    assert [o["type"] for o in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"][0]["text"] == "Let me see"
    assert whole["output"][1]["content"][0]["text"] == "\n\nBlue!"
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 7
    chunks = run_job(worker, {"openai_route": "/v1/responses", "openai_input": body | {"stream": True}})
    events = [json.loads(e.split("data: ", 1)[1]) for c in chunks for e in c.split("\n\n") if "data: " in e]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    thinking = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thinking, answer) == ("Let me see", "\n\nBlue!")
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and [o["type"] for o in final["output"]] == [
        "reasoning",
        "message",
    ]


def test_a_thinking_block_in_anthropics_messages(engines):
    worker = Worker(load_settings({"REASONING_PARSER": "deepseek_r1"}), engines["think"])
    body = {"model": worker.served_name, "max_tokens": 40, "messages": [{"role": "user", "content": "Which colour?"}]}
    msg = run_job(worker, {"openai_route": "/v1/messages", "openai_input": body})[0]
    assert [b["type"] for b in msg["content"]] == ["thinking", "text"] and msg["content"][0]["thinking"] == "Let me see"
