"""Tool calling on the chat route, as vLLM's OpenAI server does it.

- `tool_choice` "none": tools reach the chat template, the output is plain content. "auto" (needs
  ENABLE_AUTO_TOOL_CHOICE and TOOL_CALL_PARSER, worker-vllm's settings): the output is parsed for calls in the
  parser's format, `hermes` (<tool_call>{"name", "arguments"}</tool_call>) or `llama3_json` ({"name",
  "parameters"} objects, `;`-separated, after an optional <|python_tag|>). "required" and a named function are
  enforced by a grammar: an array of {name, arguments} whose arguments follow their tool's schema, or (named) the
  arguments object itself, so even a 135M model returns a valid call.
- `parallel_tool_calls: false` allows at most one call: "required" asks the grammar for exactly one, "auto"
  keeps the first call the output makes (as vLLM does) and drops what follows it.
- `ToolCallStream` turns the output text into OpenAI's message parts as it grows: content deltas, then per call a
  first delta with index, id, type and function.name, and argument fragments after it. The whole-response path
  feeds the full text through the same stream, so streamed deltas reassemble into the same calls.
- History: assistant messages with `tool_calls` and `tool` messages render through the chat template; a template
  that does not know tool calls gets them as text in the parser's format."""

from __future__ import annotations

import json
import uuid
from typing import Any

from engine import StructuredOutputsParams
from handler.schemas import JobError

PARSERS = ("hermes", "llama3_json")
_ARGS = ("arguments", "parameters")


def plan(tools: list[dict] | None, tool_choice: Any, settings, where: str = "openai_input", parallel: bool = True):
    """(mode, named function, grammar) for a request: mode None (no parsing), "auto:<parser>", "required" or
    "named". parallel=False: at most one call. Raises JobError naming the field for what cannot be served."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise JobError(f"{where}.tool_choice: {tool_choice!r} needs tools", param=f"{where}.tool_choice")
        return None, None, None
    funcs = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise JobError(
                "each tool must be {'type': 'function', 'function': {'name', ...}}", param=f"{where}.tools.{i}"
            )
        funcs[f["name"]] = f.get("parameters") or {"type": "object", "properties": {}}
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None, None, None
    if choice == "auto":
        parser = settings.TOOL_CALL_PARSER
        if not (settings.ENABLE_AUTO_TOOL_CHOICE and parser):
            raise JobError(
                f'{where}.tool_choice: "auto" needs ENABLE_AUTO_TOOL_CHOICE=true and TOOL_CALL_PARSER (hermes or '
                'llama3_json) on this worker; send tool_choice "required", "none" or a named function instead',
                param=f"{where}.tool_choice",
            )
        return f"auto:{parser}", None, None
    field = f"{where}.tool_choice"
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": schema},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, schema in funcs.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return "required", None, StructuredOutputsParams(json=schema, field=field)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name not in funcs:
        raise JobError(f"{field} names {name!r}, which is not among the tools {sorted(funcs)}", param=field)
    return "named", name, StructuredOutputsParams(json=funcs[name], field=field)


def history(messages: list[dict], parser: str | None, template: str | None) -> list[dict]:
    """Messages for the chat template: tool calls' arguments as objects (what templates expect); where the
    template never mentions tool_calls, each call as text in the parser's format instead."""
    knows = template is not None and "tool_calls" in template
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            fns = [
                {"name": c["function"]["name"], "arguments": _loads(c["function"].get("arguments", "{}"))}
                for c in calls
            ]
            if knows:
                m = {**m, "tool_calls": [{**c, "function": f} for c, f in zip(calls, fns)]}
            else:
                text = "\n".join(_as_text(f, parser) for f in fns)
                m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": ((m.get("content") or "") + text)}
        out.append(m)
    return out


def _as_text(fn: dict, parser: str | None) -> str:
    if parser == "llama3_json":
        return json.dumps({"name": fn["name"], "parameters": fn["arguments"]})
    return f"<tool_call>\n{json.dumps(fn)}\n</tool_call>"


def _loads(s):
    try:
        return json.loads(s) if isinstance(s, str) else s
    except json.JSONDecodeError:
        return s


def scan_object(text: str) -> tuple[str | None, int | None, int | None, int | None]:
    """For the JSON object text starting at text[0] == '{' (possibly incomplete): (the "name" value once its string
    is closed, where the "arguments"/"parameters" value starts, where it ends, where the object ends)."""
    depth, in_str, esc, str_start = 0, False, False, 0
    key, expect, name, a0, a1 = None, False, None, None, None
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 1:
                    s = _loads(text[str_start : i + 1])
                    if not expect:
                        key = s
                    else:
                        if key == "name":
                            name = s
                        if key in _ARGS and a1 is None:
                            a1 = i + 1
                        expect = False
            continue
        at_value = depth == 1 and expect and key in _ARGS and a0 is None
        if ch == '"':
            in_str, str_start = True, i
            a0 = i if at_value else a0
        elif ch in "{[":
            a0 = i if at_value else a0
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 1 and expect:
                a1 = i + 1 if key in _ARGS and a1 is None else a1
                expect = False
            if depth == 0:
                return name, a0, a1, i + 1
        elif depth == 1 and ch == ":":
            expect = True
        elif depth == 1 and ch == ",":
            if expect and key in _ARGS and a0 is not None and a1 is None:
                a1 = i
            expect = False
        elif depth == 1 and expect and not ch.isspace():
            a0 = i if at_value else a0  # a bare value (number, true, ...)
    return name, a0, a1, None


class ToolCallStream:
    """Feed the output text as it grows; get OpenAI delta parts back. mode: "named", "required" or "auto:<parser>";
    max_calls: after that many complete calls the rest of the output is dropped (parallel_tool_calls false)."""

    def __init__(self, mode: str, name: str | None = None, max_calls: int | None = None):
        self.mode, self.name, self.max_calls = mode, name, max_calls
        self.closed = False  # max_calls reached: nothing more is parsed
        self.text = ""
        self.content_sent = 0  # text before this is content (known not to start a call)
        self.content_out = 0  # ... of which this much has been returned
        self.calls: list[dict] = []  # per call: id, name, args text sent so far
        self.cursor = 0  # where the next call object may start

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content delta, tool_call deltas)."""
        self.text += delta
        if self.mode == "named":
            out = []
            if not self.calls:
                self.calls.append({"id": _call_id(), "name": self.name, "sent": ""})
                out.append(self._head(0))
            if delta:
                out.append(self._args(0, delta))
                self.calls[0]["sent"] += delta
            return "", out
        return self._segments()

    def _segments(self) -> tuple[str, list[dict]]:
        out = []
        while True:
            start = self._next_object()
            if start is None:
                break
            if start is False:  # not a call (auto mode): the rest is content
                self.content_sent = len(self.text)
                break
            name, a0, a1, end = scan_object(self.text[start:])
            i = self._call_index(start)
            if i is None and name is not None:
                self.calls.append({"id": _call_id(), "name": name, "sent": "", "start": start})
                i = len(self.calls) - 1
                out.append(self._head(i))
            if i is not None and a0 is not None:
                args = self.text[start + a0 : start + (a1 if a1 is not None else len(self.text) - start)]
                new = args[len(self.calls[i]["sent"]) :]
                if new:
                    out.append(self._args(i, new))
                    self.calls[i]["sent"] = args
            if end is None:
                break
            self.cursor = start + end
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                self.closed = True
                break
        content = self.text[self.content_out : self.content_sent]
        self.content_out = self.content_sent
        return content, out

    def _next_object(self):
        """Where the next call object starts (None: not yet known; False: the output is content, not calls)."""
        if self.closed:
            return None
        rest = self.text[self.cursor :]
        if self.mode == "required":
            j = rest.find("{")
            return None if j < 0 else self.cursor + j
        parser = self.mode.split(":", 1)[1]
        if parser == "hermes":
            tag = "<tool_call>"
            j = rest.find(tag)
            if j < 0:  # content up to a possible partial tag
                if not self.calls:
                    keep = next((k for k in range(len(tag), 0, -1) if self.text.endswith(tag[:k])), 0)
                    self.content_sent = max(self.content_sent, len(self.text) - keep)
                return None
            if not self.calls:
                self.content_sent = max(self.content_sent, self.cursor + j)
            k = rest.find("{", j)
            return None if k < 0 else self.cursor + k
        tag = "<|python_tag|>"
        stripped = rest.lstrip().removeprefix(tag).lstrip().lstrip(";").lstrip()
        if not stripped or (not self.calls and tag.startswith(stripped)):
            return None  # nothing yet, or what may become the tag
        if stripped[0] != "{":
            return False if not self.calls else None
        return self.cursor + rest.index("{")

    def _call_index(self, start: int) -> int | None:
        return next((i for i, c in enumerate(self.calls) if c.get("start", start) == start), None)

    def _head(self, i: int) -> dict:
        c = self.calls[i]
        return {"index": i, "id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": ""}}

    @staticmethod
    def _args(i: int, fragment: str) -> dict:
        return {"index": i, "function": {"arguments": fragment}}

    def pending_content(self) -> str:
        """At the end: held-back text (a partial tag that never completed) is content after all."""
        if self.calls or self.mode in ("named", "required"):
            return ""
        self.content_sent = len(self.text)
        rest = self.text[self.content_out :]
        self.content_out = len(self.text)
        return rest

    def message(self) -> tuple[str | None, list[dict]]:
        """The whole message: (content, tool_calls in OpenAI's shape, arguments as JSON text)."""
        calls = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["sent"]}}
            for c in self.calls
        ]
        content = self.text[: self.content_sent] if self.mode.startswith("auto") else None
        if self.mode.startswith("auto") and not calls:
            content = self.text
        return (content.strip() or None) if content is not None else None, calls


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"
