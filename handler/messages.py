"""Chat history as OpenAI's SDK sends it (a previous response's `message.model_dump()` appended as is), made into
the messages a chat template expects.

- Every field of OpenAI's request schema for each role is accepted; null means absent. Content is a string or a
  list of parts: text parts on every role, refusal parts on assistant messages (read as text, as vLLM does). A part
  this worker cannot serve (image_url, input_audio, file, ...) is refused naming its type at
  messages.N.content.M.type (`check_parts`).
- For the template (`for_template`): text parts are joined with "\\n" (vLLM's "string" content format) unless the
  template loops over a message's content (vLLM's "openai" format: it gets the parts, as transformers hands them);
  `developer` becomes `system` unless the template knows the role; an assistant's `refusal` is its text when it has
  no content; the deprecated functions API's history (an assistant `function_call`, then a `function` message) becomes
  a tool call and its tool message, so templates and tool_calls.history render it as the tools API's."""

from __future__ import annotations

import logging
from typing import Any

from engine import template_iterates_content as iterates_content

log = logging.getLogger("handler")

# part type -> the key its text is under; refusal parts only in assistant messages (OpenAI's schema)
_TEXT_KEY = {"text": "text", "refusal": "refusal"}
_PART_KEYS = {"text": {"type", "text", "prompt_cache_breakpoint"}, "refusal": {"type", "refusal"}}
# parts of OpenAI's (and vLLM's) schema that carry media: this worker's models read text only
_MEDIA_PARTS = ("image_url", "input_audio", "file", "audio_url", "video_url", "image_embeds")
_warned_breakpoint = False


class FieldError(ValueError):
    """A validation error at `path` below the field being validated; schemas.parse() appends the path to the
    field's own location, so the error names e.g. messages.1.content.0.type."""

    def __init__(self, message: str, *path: str | int):
        super().__init__(message)
        self.path = path


def check_field(field: str, value: Any, role: str | None) -> Any:
    """schemas.Message's checks of a non-null field: content parts, tool calls, a function call; audio is refused."""
    if field == "content":
        return check_parts(value, role) if isinstance(value, list) else value
    if field == "tool_calls":
        return check_tool_calls(value)
    if field == "function_call":
        return check_function(value)
    raise ValueError("an audio answer cannot be replayed: this worker has no audio; send its transcript as content")


def check_parts(parts: list, role: str | None) -> list[dict]:
    """OpenAI content parts -> [{"type": "text", "text": ...}]; raises FieldError at the offending part."""
    global _warned_breakpoint
    out = []
    for i, p in enumerate(parts):
        if not isinstance(p, dict):
            raise FieldError("a content part is an object such as {'type': 'text', 'text': '...'}", i)
        kind = p.get("type")
        if not isinstance(kind, str):
            raise FieldError("a content part needs a 'type' (a string: 'text')", i, "type")
        if kind == "refusal" and role != "assistant":
            raise FieldError(f"refusal parts belong to assistant messages, not {role}", i, "type")
        if kind in _TEXT_KEY:
            key = _TEXT_KEY[kind]
            if not isinstance(p.get(key), str):
                raise FieldError(f"a {kind} part needs {key!r}: a string", i, key)
            extra = sorted(set(p) - _PART_KEYS[kind])
            if extra:
                raise FieldError("unknown field", i, extra[0])
            if "prompt_cache_breakpoint" in p and not _warned_breakpoint:  # OpenAI's cache hint: caching is ours
                _warned_breakpoint = True
                log.warning("content parts' prompt_cache_breakpoint is accepted and ignored: the prefix cache finds "
                            "shared prefixes by itself")  # fmt: skip
            out.append({"type": "text", "text": p[key]})
        elif kind in _MEDIA_PARTS:
            why = f"{kind} content parts are not supported: this worker's model reads text only; send text parts"
            raise FieldError(why, i, "type")
        else:
            raise FieldError(f"unknown content part type {kind!r}; this worker reads 'text' parts", i, "type")
    return out


def check_tool_calls(calls: list) -> list[dict]:
    """An assistant's tool_calls (OpenAI's function tool calls); a custom tool call or a malformed one is refused
    at its path."""
    for i, c in enumerate(calls):
        if not isinstance(c, dict):
            raise FieldError("a tool call is an object {'id', 'type': 'function', 'function': {...}}", i)
        if c.get("type", "function") != "function":
            raise FieldError(f"tool calls of type {c.get('type')!r} are not supported; only 'function'", i, "type")
        extra = sorted(set(c) - {"id", "type", "function"})
        if extra:
            raise FieldError("unknown field", i, extra[0])
        check_function(c.get("function"), i, "function")
    return calls


def check_function(f: Any, *path: str | int) -> dict:
    """{"name": str, "arguments": str (JSON text) or an object}, as a tool call's or a function_call's function."""
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise FieldError("needs an object {'name': str, 'arguments': str}", *path)
    if not isinstance(f.get("arguments", "{}"), (str, dict)):
        raise FieldError("arguments must be a string (JSON text) or an object", *path, "arguments")
    extra = sorted(set(f) - {"name", "arguments"})
    if extra:
        raise FieldError("unknown field", *path, extra[0])
    return f


def pick_template(own: str | dict | None, requested: str | None, tools: list | None) -> str:
    """The template source a render will use (engine Tokenizer._pick_template's choice): the request's (a template,
    or the name of one of the model's), else the model's (tool_use when tools are given and it has one)."""
    if isinstance(own, dict):
        if requested in own:
            return own[requested]
        return requested or own.get("tool_use" if tools and "tool_use" in own else "default") or ""
    return requested or own or ""


def for_template(messages: list[dict], template: str) -> list[dict]:
    """Messages (model_dump(exclude_none=True) of schemas.Message) -> what `template` is rendered with."""
    parts_ok, knows_developer = iterates_content(template), "developer" in template
    out, call_ids = [], {}  # function name -> id of its last function_call (a function message answers it)
    for i, m in enumerate(messages):
        m = {k: v for k, v in m.items() if k not in ("annotations", "audio")}  # annotations: ignored; audio: null
        if m["role"] == "developer" and not knows_developer:
            m["role"] = "system"
        if isinstance(m.get("content"), list) and not parts_ok:
            m["content"] = "\n".join(p["text"] for p in m["content"])
        refusal = m.pop("refusal", None)
        if refusal is not None:  # what the assistant said when it refused
            m["content"] = refusal if not m.get("content") else f"{text_of(m['content'])}\n{refusal}"
        if fc := m.pop("function_call", None):
            call_ids[fc["name"]] = cid = f"call_fn_{i}"
            fn = {"name": fc["name"], "arguments": fc.get("arguments", "{}")}
            call = {"id": cid, "type": "function", "function": fn}
            m["tool_calls"] = [*m.get("tool_calls", []), call]
        if m["role"] == "function":  # the deprecated API's result message: a tool message answering the call
            m = {**m, "role": "tool", "tool_call_id": call_ids.get(m.get("name"), f"call_fn_{m.get('name')}")}
            if m.get("content") is None:
                m["content"] = ""
        out.append(m)
    return out


def last_text(messages: list[dict], role: str) -> str:
    """vLLM's chat `echo`: the last message's text when it has `role` (what the new message continues), else ""."""
    m = messages[-1]
    return text_of(m.get("content")) if m.get("role") == role else ""


def text_of(content: str | list[dict] | None) -> str:
    """A message's content as text: a string, or its parts' texts a line each ("" for none)."""
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content or ())
