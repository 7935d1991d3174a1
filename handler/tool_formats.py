"""The tool-call formats TOOL_CALL_PARSER names (vLLM's parser names), read from a reply's text as it grows.

Each format is a scanner: scan(text, pos, first, schemas) reads the calls that start at or after `pos` (the end of
the last complete call) and says where the reply's content ends. A call's `args` is OpenAI's arguments JSON as far
as the text shows it, and only ever grows by appending as the text grows, so a stream sends the difference.

- `hermes`: `<tool_call>{"name": .., "arguments": {..}}</tool_call>` (Qwen2.5 and Qwen3, Hermes, SmolLM).
- `llama3_json`: `{"name": .., "parameters": {..}}` objects, `;`-separated, after an optional `<|python_tag|>`
  (Llama 3.1 to 3.3).
- `mistral`: `[TOOL_CALLS][{"name": .., "arguments": {..}}]`, or from tokenizer v11 on `[TOOL_CALLS]name[ARGS]{..}`
  for each call (Mistral, Devstral). `[TOOL_CALLS]` is a special token: the request decodes with
  skip_special_tokens false, as vLLM's parser asks.
- `pythonic` (also `llama4_pythonic`): `[f(a=1, b="x"), g()]`, optionally inside `<|python_start|>` and
  `<|python_end|>` (Llama 3.2, Llama 4).
- `qwen3_coder` (also `qwen3_xml`): `<tool_call><function=f><parameter=a>1</parameter></function></tool_call>`, each
  value converted by its parameter's schema type (Qwen3-Coder, Qwen3.5).

Text before the first call is content; text after the calls is dropped (as vLLM). A reply that does not start a
call where the format says calls start (llama3_json, pythonic) is all content."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

ALIASES = {"llama4_pythonic": "pythonic", "qwen3_xml": "qwen3_coder"}  # vLLM's other names for the same formats
_ARGS = ("arguments", "parameters")
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


@dataclass
class Call:
    name: str
    args: str  # the arguments JSON so far
    end: int | None = None  # where the call's text ends, once it is complete


@dataclass
class Scan:
    content_end: int  # text[:content_end] is content, whatever comes next (meaningful before the first call)
    calls: list[Call] = field(default_factory=list)
    plain: bool = False  # the reply is not calls at all: every character is content


def scan(fmt: str, text: str, pos: int, first: bool, schemas: dict[str, dict]) -> Scan:
    fmt = ALIASES.get(fmt, fmt)
    if fmt == "required":  # our grammar's array of {"name", "arguments"}
        return Scan(0, _objects(text, text.find("[", pos) + 1 if first else pos)[0])
    return _SCANNERS[fmt](text, pos, first, schemas)


# ---- JSON objects: hermes, llama3_json, mistral and the grammar's array -------------------------------------------
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


def _objects(text: str, pos: int, seps: str = " \t\r\n,;") -> tuple[list[Call], int]:
    """The {"name", "arguments" | "parameters"} objects from pos on, separators between them skipped: (calls, where
    the text stopped being objects). An object without a name is passed over."""
    calls = []
    while True:
        while pos < len(text) and text[pos] in seps:
            pos += 1
        if pos >= len(text) or text[pos] != "{":
            return calls, pos
        name, a0, a1, end = scan_object(text[pos:])
        if name is not None:
            a1 = a1 if a1 is not None else (len(text) - pos if end is None else end - 1)  # a bare value: to the "}"
            args = "" if a0 is None else text[pos + a0 : pos + a1]
            calls.append(Call(name, args, None if end is None else pos + end))
        if end is None:
            return calls, len(text)
        pos += end


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Where content ends when no tag has started: before a tail that may still become one of `tags`."""
    keep = max((k for t in tags for k in range(len(t), 0, -1) if text.endswith(t[:k])), default=0)
    return len(text) - keep


def _tagged(text: str, pos: int, first: bool, tag: str) -> tuple[int, int]:
    """(content end, where the calls' text starts or -1) for formats whose calls follow a tag."""
    j = text.find(tag, pos)
    if j < 0:
        return (_held(text, (tag,)) if first else 0), -1
    return j, j + len(tag)


def _hermes(text: str, pos: int, first: bool, schemas) -> Scan:
    content_end, at = _tagged(text, pos, first, "<tool_call>")
    out = Scan(content_end)
    while at >= 0:
        calls, _ = _objects(text, at)
        out.calls += calls[:1]  # one object a tag
        if not calls or calls[0].end is None:
            break
        at = text.find("<tool_call>", calls[0].end)
        at = at + len("<tool_call>") if at >= 0 else -1
    return out


def _llama3_json(text: str, pos: int, first: bool, schemas) -> Scan:
    tag = "<|python_tag|>"
    rest = text[pos:].lstrip()
    if first:
        if not rest or tag.startswith(rest):
            return Scan(0)  # nothing yet, or what may become the tag
        rest = rest.removeprefix(tag).lstrip()
        if rest and rest[0] != "{":
            return Scan(len(text), plain=True)
    start = text.find("{", pos)
    return Scan(0, _objects(text, start)[0] if start >= 0 else [])


def _mistral(text: str, pos: int, first: bool, schemas) -> Scan:
    tag = "[TOOL_CALLS]"
    content_end, at = _tagged(text, pos, first, tag) if first else (0, pos)
    out = Scan(content_end)
    while at >= 0:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if text.startswith(tag, at):
            at += len(tag)
        elif text.startswith("[", at) and not text.startswith("[T", at):  # before v11: a JSON array of calls
            at += 1
        elif text.startswith("{", at):
            out.calls += _objects(text, at)[0]
            return out
        elif m := _V11.match(text, at):  # v11+: name[ARGS]{args}, each call after its own tag
            k = m.end()
            end = scan_object(text[k:])[3]
            out.calls.append(Call(m.group(1), text[k : len(text) if end is None else k + end]))
            if end is None:
                return out
            out.calls[-1].end = at = k + end
        else:
            return out
    return out


_V11 = re.compile(r"([A-Za-z_][\w.\-]*)\s*(?:\[ARGS\])?\s*(?=\{)")


# ---- pythonic: [f(a=1), g(b="x")] ---------------------------------------------------------------------------------
def _pythonic(text: str, pos: int, first: bool, schemas) -> Scan:
    start = "<|python_start|>"
    if first:
        rest = text.lstrip()
        if not rest or start.startswith(rest):
            return Scan(0)
        pos = len(text) - len(rest.removeprefix(start).lstrip())
        if pos == len(text):
            return Scan(0)
        if text[pos] != "[":
            return Scan(len(text), plain=True)
        pos += 1
    out = Scan(0)
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        m = _NAME.match(text, pos)
        if not m and first and not out.calls and pos < len(text) and text[pos] != "]":
            return Scan(len(text), plain=True)  # "[1, 2]": text, not calls
        if not m or m.end() == len(text):
            return out  # the list's end, or a name still being written
        if text[m.end()] != "(":
            if first and not out.calls:
                return Scan(len(text), plain=True)  # "[Paris](...)": text, not a call
            return out
        close = _close_paren(text, m.end())
        call = Call(m.group(), "")
        if close is not None:
            call.args, call.end = _py_args(text[pos : close + 1]), close + 1
        out.calls.append(call)
        if close is None:
            return out
        pos = close + 1


def _close_paren(text: str, i: int) -> int | None:
    """Where the parenthesis opened at text[i] closes (Python strings skipped), or None while it is open."""
    depth, quote, esc = 0, None, False
    for j in range(i, len(text)):
        ch = text[j]
        if quote:
            esc, quote = (not esc and ch == "\\"), (None if ch == quote and not esc else quote)
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return j
    return None


def _py_args(src: str) -> str:
    """A call's keyword arguments as a JSON object; a value that is not a literal is kept as its source text."""
    try:
        call = ast.parse(src, mode="eval").body
    except SyntaxError:
        return "{}"
    out = {}
    for kw in getattr(call, "keywords", []):
        try:
            out[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, SyntaxError, TypeError):
            out[kw.arg] = ast.get_source_segment(src, kw.value)
    return json.dumps(out, ensure_ascii=False, default=str)


# ---- qwen3_coder: <function=f><parameter=a>1</parameter></function> -----------------------------------------------
_PARAM = re.compile(r"<parameter=([^>]*)>(.*?)</parameter>", re.DOTALL)
# a whole call also takes a parameter its model left unclosed before the next one or the call's end (as vLLM)
_PARAM_LAX = re.compile(r"<parameter=([^>]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _qwen3_coder(text: str, pos: int, first: bool, schemas) -> Scan:
    starts = [j for j in (text.find("<tool_call>", pos), text.find("<function=", pos)) if j >= 0]
    out = Scan(min(starts) if starts else (_held(text, ("<tool_call>", "<function=")) if first else 0))
    at = text.find("<function=", pos)
    while at >= 0:
        head_end = text.find(">", at)
        if head_end < 0:
            break
        name = text[at + len("<function=") : head_end].strip()
        body_end = text.find("</function>", head_end)
        body = text[head_end + 1 : len(text) if body_end < 0 else body_end]
        params = (_PARAM if body_end < 0 else _PARAM_LAX).findall(body)
        types = (schemas.get(name) or {}).get("properties") or {}
        pairs = [f"{json.dumps(k.strip())}: {_typed(v, types.get(k.strip()))}" for k, v in params]
        call = Call(name, "{" + ", ".join(pairs) + ("}" if body_end >= 0 else ""))
        out.calls.append(call)
        if body_end < 0:
            break
        call.end = body_end + len("</function>")
        at = text.find("<function=", call.end)
    return out


def _typed(raw: str, schema: dict | None) -> str:
    """A parameter's text as the JSON value its schema's type asks for (vLLM's conversions); text otherwise."""
    v = raw.removeprefix("\n").removesuffix("\n")
    kind = (schema or {}).get("type", "string")
    kind = next((k for k in kind if k != "null"), "string") if isinstance(kind, list) else kind
    if v.strip().lower() == "null":  # whatever the type, as vLLM reads it
        return "null"
    try:
        if kind in ("integer", "int"):
            return json.dumps(int(v.strip()))
        if kind in ("number", "float"):
            f = float(v.strip())
            return json.dumps(int(f) if f.is_integer() else f)
        if kind in ("boolean", "bool") and v.strip().lower() in ("true", "false"):
            return v.strip().lower()
        if kind not in ("string", "str", "text", "boolean", "bool"):
            try:
                return json.dumps(json.loads(v))
            except json.JSONDecodeError:
                return json.dumps(ast.literal_eval(v), ensure_ascii=False)
    except (ValueError, SyntaxError, TypeError, OverflowError):
        pass
    return json.dumps(v, ensure_ascii=False)


_SCANNERS = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
    "mistral": _mistral,
    "pythonic": _pythonic,
    "qwen3_coder": _qwen3_coder,
}
PARSERS = (*_SCANNERS, *ALIASES)


# ---- a call written back as the model would have written it (history for templates without tool_calls) -----------
def as_text(fmt: str, name: str, args) -> str:
    fmt = ALIASES.get(fmt, fmt)
    args = args if isinstance(args, dict) else {}
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": args})
    if fmt == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": args}])
    if fmt == "pythonic":
        return f"[{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})]"
    if fmt == "qwen3_coder":
        ps = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in args.items()
        )
        return f"<tool_call>\n<function={name}>\n{ps}</function>\n</tool_call>"
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def _loads(s):
    try:
        return json.loads(s) if isinstance(s, str) else s
    except json.JSONDecodeError:
        return s
