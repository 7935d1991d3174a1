"""OpenAI's Responses API (`POST /v1/responses`), stateless text and function tools, over the chat route: the request
becomes a chat completion's body and runs through the same chat job (template, validation, reasoning parser, tool
calls, grammars); the reply is shaped as a response, or streamed as the Responses event protocol (response.created,
output_item.added, output_text.delta, function_call_arguments.delta, ..., response.completed, each with a sequence
number).

`store` (default true) keeps a response in this worker's memory (an LRU of STORED responses) so that a later request's
`previous_response_id` continues it: its input and output come first. A response id is known only to the worker that
made it; on a load-balancing endpoint, pin the conversation to it (X-Runpod-Worker-Id). Refused, naming the field:
built-in tools (web search, file search, code interpreter, ...), non-text input parts, background, conversation."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field

from handler import openai_compat as oa
from handler.schemas import JobError, _Strict, parse

RESPONSES = "/v1/responses"
STORED = 256  # responses kept per worker for previous_response_id
_store: OrderedDict[str, tuple[list, list]] = OrderedDict()  # id -> (its input items, its output items)
_lock = threading.Lock()


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    # accepted and ignored
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # refused
    background: bool | None = None
    conversation: Any = None


def parse_request(body: Any, where: str) -> tuple[ResponsesRequest, list]:
    """The request, and its whole input as items (a previous response's first, when it names one)."""
    req = parse(ResponsesRequest, body, where)
    if req.background:
        raise JobError("background responses are not supported here", param="background")
    if req.conversation is not None:
        raise JobError("conversation objects are not supported here: use previous_response_id", param="conversation")
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if req.previous_response_id:
        with _lock:
            prev = _store.get(req.previous_response_id)
        if prev is None:
            raise JobError(
                f"previous response {req.previous_response_id!r} is not known to this worker (responses are "
                "kept in the memory of the worker that made them)",
                param="previous_response_id",
                type="not_found_error",
                code="previous_response_not_found",
                status=404,
            )
        items = prev[0] + prev[1] + items
    return req, items


def chat_body(req: ResponsesRequest, items: list) -> dict:
    msgs: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for i, it in enumerate(items):
        kind, where = it.get("type", "message"), f"input.{i}"
        if kind == "message":
            msgs.append({"role": it.get("role", "user"), "content": _text(it.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": it.get("call_id"),
                "type": "function",
                "function": {"name": it.get("name"), "arguments": it.get("arguments") or "{}"},
            }
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id"), "content": _text(it.get("output"), where)})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: templates drop it
        else:
            raise JobError(f"{where}: input items of type {kind!r} are not supported here", param=where)
    body: dict[str, Any] = {"model": req.model, "messages": msgs, "stream": req.stream}
    if req.tools:
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise JobError(
                    f"tools.{i}: the built-in tool {t.get('type')!r} is not available here; only function tools are",
                    param=f"tools.{i}.type",
                )
        body["tools"] = [
            {
                "type": "function",
                "function": {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None},
            }
            for t in req.tools
        ]
    if req.tool_choice is not None:
        tc = req.tool_choice
        body["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}} if isinstance(tc, dict) else tc
    fmt = (req.text or {}).get("format") or {}
    if fmt.get("type") == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema")},
        }
    elif fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.reasoning and req.reasoning.get("effort"):
        body["reasoning_effort"] = req.reasoning["effort"]
    body |= {
        k: v
        for k, v in (
            ("max_tokens", req.max_output_tokens),
            ("temperature", req.temperature),
            ("top_p", req.top_p),
            ("parallel_tool_calls", req.parallel_tool_calls),
        )
        if v is not None
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise JobError(f"{where}.content.{j}: {kind!r} parts are not supported here", param=f"{where}.content.{j}")
        parts.append(str(p.get("text", "")))
    return "".join(parts)


class _Shaper:
    """One response's id, items and lifecycle."""

    def __init__(self, req: ResponsesRequest, items: list, model: str):
        self.req, self.items, self.model = req, items, model
        self.id, self.created = oa.new_id("resp"), int(time.time())

    def response(self, status: str, output: list, usage: dict | None, incomplete: bool = False) -> dict:
        r = self.req
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "instructions": r.instructions,
            "tools": r.tools or [],
            "tool_choice": r.tool_choice or "auto",
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id,
            "store": r.store,
            "metadata": r.metadata or {},
            "text": r.text or {"format": {"type": "text"}},
            "reasoning": r.reasoning,
            "truncation": "disabled",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        }
        if usage is not None:
            details = usage.get("completion_tokens_details") or {}
            out["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            }
        return out

    def finish(self, output: list, usage: dict, finish_reason: str | None) -> dict:
        incomplete = finish_reason == "length"
        resp = self.response("incomplete" if incomplete else "completed", output, usage, incomplete)
        if self.req.store:
            with _lock:
                _store[self.id] = (self.items, output)
                while len(_store) > STORED:
                    _store.popitem(last=False)
        return resp


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {
        "type": "reasoning",
        "id": oa.new_id("rs"),
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _message_item(text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": oa.new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed"
        else [],
    }


def _call_item(call: dict, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": oa.new_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
        "status": status,
    }


def whole(req: ResponsesRequest, items: list, chat: dict) -> dict:
    shaper = _Shaper(req, items, chat["model"])
    choice = chat["choices"][0]
    m, output = choice["message"], []
    if m.get("reasoning"):
        output.append(_reasoning_item(m["reasoning"]))
    if m.get("content"):
        output.append(_message_item(m["content"]))
    output += [_call_item(c) for c in m.get("tool_calls") or []]
    return shaper.finish(output, chat["usage"], choice["finish_reason"])


async def events(req: ResponsesRequest, items: list, model: str, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A streamed chat completion's SSE (with continuous usage) as the Responses event protocol."""
    shaper, seq = _Shaper(req, items, model), [0]

    def ev(kind: str, **data) -> str:
        seq[0] += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq[0] - 1, **data})}\n\n"

    output: list[dict] = []  # finished items
    cur: dict | None = None  # the item being streamed, and its text so far
    usage, finish = None, None
    yield ev("response.created", response=shaper.response("in_progress", [], None)) + ev(
        "response.in_progress", response=shaper.response("in_progress", [], None)
    )

    def close() -> list[str]:
        nonlocal cur
        if cur is None:
            return []
        item, idx, out = cur["item"], len(output), []
        if item["type"] == "reasoning":
            item = _reasoning_item(cur["text"]) | {"id": item["id"]}
            out.append(
                ev(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=cur["text"],
                )
            )
        elif item["type"] == "message":
            item = _message_item(cur["text"]) | {"id": item["id"]}
            part = item["content"][0]
            out += [
                ev(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=cur["text"],
                    logprobs=[],
                ),
                ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part),
            ]
        else:
            item = item | {"arguments": cur["text"], "status": "completed"}
            out.append(
                ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=idx,
                    arguments=cur["text"],
                    name=item["name"],
                )
            )
        out.append(ev("response.output_item.done", output_index=idx, item=item))
        output.append(item)
        cur = None
        return out

    def open_item(item: dict) -> list[str]:
        nonlocal cur
        out = close()
        cur, idx = {"item": item, "text": ""}, len(output)
        out.append(ev("response.output_item.added", output_index=idx, item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(
                ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0, part=part)
            )
        return out

    async for group in chunks:
        out: list[str] = []
        for chunk in oa.sse_objects(group):
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                d = choice.get("delta") or {}
                finish = choice.get("finish_reason") or finish
                for kind, value in [("reasoning", d.get("reasoning")), ("message", d.get("content"))] + [
                    ("function_call", tc) for tc in d.get("tool_calls") or []
                ]:
                    if not value:
                        continue
                    idx = len(output)
                    if kind == "function_call":
                        if "id" in value:
                            out += open_item(_call_item(value, "in_progress"))
                        delta = value["function"].get("arguments", "")
                        if delta:
                            cur["text"] += delta
                            out.append(
                                ev(
                                    "response.function_call_arguments.delta",
                                    item_id=cur["item"]["id"],
                                    output_index=len(output),
                                    delta=delta,
                                )
                            )
                        continue
                    if cur is None or cur["item"]["type"] != kind:
                        new = (
                            _reasoning_item("", "in_progress")
                            if kind == "reasoning"
                            else _message_item("", "in_progress")
                        )
                        out += open_item(new | ({"content": []} if kind == "reasoning" else {}))
                        idx = len(output)
                    cur["text"] += value
                    name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                    extra = {} if kind == "reasoning" else {"logprobs": []}
                    out.append(
                        ev(name, item_id=cur["item"]["id"], output_index=idx, content_index=0, delta=value, **extra)
                    )
        if out:
            yield "".join(out)
    tail = close()
    final = shaper.finish(output, usage, finish)
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield "".join([*tail, ev(kind, response=final)])
