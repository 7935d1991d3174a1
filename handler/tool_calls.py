"""Tool calling on the chat route, as vLLM's OpenAI server does it.

- `tool_choice` "none": tools reach the chat template, the output is plain content. "auto" (needs
  ENABLE_AUTO_TOOL_CHOICE and TOOL_CALL_PARSER, worker-vllm's settings): the output is parsed for calls in the
  parser's format (handler/tool_formats.py: hermes, llama3_json, mistral, pythonic, qwen3_coder). "required" and
  a named function are enforced by a grammar, whatever the parser: an array of {name, arguments} whose arguments
  follow their tool's schema, or (named) the arguments object itself, so even a 135M model returns a valid call.
- `parallel_tool_calls: false` allows at most one call: "required" asks the grammar for exactly one, "auto"
  keeps the first call the output makes (as vLLM does) and drops what follows it.
- `ToolCallStream` turns the output text into OpenAI's message parts as it grows: content deltas, then per call a
  first delta with index, id, type and function.name, and argument fragments after it that join into the
  arguments' JSON. The whole-response path feeds the full text through the same stream, so streamed deltas
  reassemble into the same calls.
- History: assistant messages with `tool_calls` and `tool` messages render through the chat template; a template
  that does not know tool calls gets them as text in the parser's format."""

from __future__ import annotations

import json
import random
import string
import uuid
from typing import Any

from engine import StructuredOutputsParams
from handler import tool_formats
from handler.schemas import JobError

PARSERS = tool_formats.PARSERS


def plan(tools: list[dict] | None, tool_choice: Any, settings, where: str = "openai_input", parallel: bool = True):
    """(mode, named function, grammar) for a request: mode None (no parsing), "auto:<parser>", "required" or
    "named". parallel=False: at most one call. Raises JobError naming the field for what cannot be served."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise JobError(f"{where}.tool_choice: {tool_choice!r} needs tools", param=f"{where}.tool_choice")
        return None, None, None
    funcs = schemas(tools, where)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None, None, None
    if choice == "auto":
        parser = settings.TOOL_CALL_PARSER
        if not (settings.ENABLE_AUTO_TOOL_CHOICE and parser):
            raise JobError(
                f'{where}.tool_choice: "auto" needs ENABLE_AUTO_TOOL_CHOICE=true and TOOL_CALL_PARSER (one of '
                f'{", ".join(PARSERS)}) on this worker; send tool_choice "required", "none" or a named function '
                "instead",
                param=f"{where}.tool_choice",
            )
        if parser == "openai":  # GPT-OSS's harmony calls: its replies take handler/harmony.py, not this
            raise JobError(
                f"{where}.tool_choice: TOOL_CALL_PARSER=openai parses GPT-OSS's harmony format, and this model is "
                "not GPT-OSS; set the parser its chat template writes",
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


def schemas(tools: list | None, where: str = "openai_input") -> dict[str, dict]:
    """{function name: its parameters' JSON schema}; JobError naming the tool that is not a function."""
    funcs = {}
    for i, t in enumerate(tools or ()):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise JobError(
                "each tool must be {'type': 'function', 'function': {'name', ...}}", param=f"{where}.tools.{i}"
            )
        funcs[f["name"]] = f.get("parameters") or {"type": "object", "properties": {}}
    return funcs


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
                text = "\n".join(tool_formats.as_text(parser or "hermes", f["name"], f["arguments"]) for f in fns)
                m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": ((m.get("content") or "") + text)}
        out.append(m)
    return out


def _loads(s):
    try:
        return json.loads(s) if isinstance(s, str) else s
    except json.JSONDecodeError:
        return s


class ToolCallStream:
    """Feed the output text as it grows; get OpenAI delta parts back. mode: "named", "required" or "auto:<parser>";
    max_calls: after that many complete calls the rest of the output is dropped (parallel_tool_calls false);
    schemas: the tools' parameter schemas (qwen3_coder's values take their types from them)."""

    def __init__(self, mode: str, name: str | None = None, max_calls: int | None = None, schemas: dict | None = None):
        self.mode, self.name, self.max_calls, self.schemas = mode, name, max_calls, schemas or {}
        self.fmt = mode.removeprefix("auto:")
        self.text = ""
        self.content_sent = 0  # text before this is content (known not to start a call)
        self.content_out = 0  # ... of which this much has been returned
        self.calls: list[dict] = []  # per call: id, name, args text sent so far
        self.done, self.cursor = 0, 0  # complete calls, and where the last of them ended
        self.plain = False  # auto: the output is not calls; all of it is content

    @property
    def closed(self) -> bool:  # max_calls reached: nothing more is parsed
        return self.max_calls is not None and self.done >= self.max_calls

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content delta, tool_call deltas)."""
        self.text += delta
        if self.mode == "named":
            out = []
            if not self.calls:
                self.calls.append({"id": call_id(self.fmt), "name": self.name, "sent": ""})
                out.append(head(0, self.calls[0]))
            if delta:
                out.append(fragment(0, delta))
                self.calls[0]["sent"] += delta
            return "", out
        out = [] if self.plain or self.closed else self._calls()
        if self.plain:
            self.content_sent = len(self.text)
        content = self.text[self.content_out : self.content_sent]
        self.content_out = self.content_sent
        return content, out

    def _calls(self) -> list[dict]:
        scan = tool_formats.scan(self.fmt, self.text, self.cursor, self.done == 0, self.schemas)
        if self.done == 0:
            self.plain = scan.plain and not self.calls
            self.content_sent = max(self.content_sent, scan.content_end)
        out, base = [], self.done
        for j, c in enumerate(scan.calls):
            i = base + j
            if self.max_calls is not None and i >= self.max_calls:
                break
            if i == len(self.calls):
                self.calls.append({"id": call_id(self.fmt), "name": c.name, "sent": ""})
                out.append(head(i, self.calls[i]))
            args = c.args or ("{}" if c.end is not None else "")  # a call without arguments: an empty object
            if new := args[len(self.calls[i]["sent"]) :]:
                out.append(fragment(i, new))
                self.calls[i]["sent"] = args
            if c.end is not None and i == self.done:
                self.done, self.cursor = i + 1, c.end
        return out

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
        calls = whole_calls(self.calls)
        content = self.text[: self.content_sent] if self.mode.startswith("auto") else None
        if self.mode.startswith("auto") and not calls:
            content = self.text
        return (content.strip() or None) if content is not None else None, calls


def head(i: int, call: dict) -> dict:
    """Call i's first delta: its index, id, type and name (call: {"id", "name", "sent"})."""
    return {"index": i, "id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": ""}}


def fragment(i: int, text: str) -> dict:
    """A piece of call i's arguments' JSON."""
    return {"index": i, "function": {"arguments": text}}


def whole_calls(calls: list[dict]) -> list[dict]:
    """The message's tool_calls in OpenAI's shape, from the streams' {"id", "name", "sent"} records."""
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["sent"]}} for c in calls]


def call_id(fmt: str) -> str:
    if fmt == "mistral":  # Mistral's templates take 9 letters and digits, nothing else
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"
