"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat route: the request is
translated into a chat completion's body, runs through the same chat job (template, validation, reasoning parser,
tool calls, grammars), and its reply is shaped as a message, or as Anthropic's stream events (message_start,
content_block_start / _delta / _stop, message_delta, message_stop). Errors in Anthropic's shape: error_body().

Translated: system (text or text blocks); user text and tool_result blocks (each a tool message); assistant text and
tool_use blocks (tool calls; thinking blocks of earlier turns are dropped); tools (input_schema: parameters);
tool_choice auto / any (required) / tool (named) / none, disable_parallel_tool_use; thinking enabled / disabled
(the template's enable_thinking); max_tokens (required), stop_sequences, temperature, top_p, top_k, stream. Refused:
image and document blocks, output_config, container. Ignored: metadata, service_tier and the service's other hints."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field

from handler import openai_compat as oa
from handler.schemas import JobError, _Strict, parse

MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
WHERE = "openai_input"
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class _Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class _Tool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" in newer SDKs
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here


class MessagesRequest(_Strict):
    model: str
    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API
    messages: list[_Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[_Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # accepted and ignored: metadata and routing hints of Anthropic's own service; prompt caching is automatic here
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # refused, naming the field: Anthropic's structured outputs and code-execution containers
    output_config: dict[str, Any] | None = None
    container: Any = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[_Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[_Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def chat_body(req: MessagesRequest | CountTokensRequest) -> dict:
    """The chat completion body this request means (its fields' paths stay Anthropic's in errors where they can)."""
    msgs: list[dict] = []
    if req.system:
        msgs.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        text, calls, results = [], [], 0
        for j, b in enumerate(blocks):
            kind, where = b.get("type"), f"messages.{i}.content.{j}"
            if kind == "text":
                text.append(str(b.get("text", "")))
            elif kind == "tool_result" and m.role == "user":
                msgs.append(
                    {
                        "role": "tool",
                        "tool_call_id": b.get("tool_use_id"),
                        "content": _text(b.get("content") or "", where),
                    }
                )
                results += 1
            elif kind == "tool_use" and m.role == "assistant":
                fn = {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}
                calls.append({"id": b.get("id"), "type": "function", "function": fn})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # an earlier turn's thinking: templates drop it too
            else:
                raise JobError(f"{where}: a {kind!r} block is not supported here", param=where)
        if text or calls or (m.role == "user" and not results):  # (a user turn of tool results only: those)
            msgs.append({"role": m.role, "content": "".join(text) or None} | ({"tool_calls": calls} if calls else {}))
    body: dict[str, Any] = {"model": req.model, "messages": msgs}
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "parameters": t.input_schema}
                | ({"description": t.description} if t.description else {}),
            }
            for t in req.tools
        ]
    if req.tool_choice:
        kind = req.tool_choice.get("type")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            choice = {"type": "function", "function": {"name": req.tool_choice.get("name")}}
        if choice is None:
            raise JobError(f"tool_choice.type {kind!r}: use auto, any, tool or none", param="tool_choice.type")
        body["tool_choice"] = choice
        if req.tool_choice.get("disable_parallel_tool_use"):
            body["parallel_tool_calls"] = False
    if req.thinking:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.get("type") == "enabled"}
    if isinstance(req, MessagesRequest):
        for name in ("output_config", "container"):
            if getattr(req, name) is not None:
                raise JobError(f"{name} is not supported here", param=name)
        body |= {"max_tokens": req.max_tokens, "stream": req.stream}
        body |= {
            k: v
            for k, v in (
                ("stop", req.stop_sequences),
                ("temperature", req.temperature),
                ("top_p", req.top_p),
                ("top_k", req.top_k),
            )
            if v is not None
        }
        if req.stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def _text(content: str | list, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for b in content:
        if not isinstance(b, dict) or b.get("type") != "text":
            raise JobError(f"{where}: only text blocks are supported here", param=where)
        parts.append(str(b.get("text", "")))
    return "".join(parts)


def parse_request(body: Any, route: str):
    return parse(MessagesRequest if route == MESSAGES else CountTokensRequest, body, WHERE)


def message(chat: dict) -> dict:
    """A whole chat completion as Anthropic's message."""
    choice = chat["choices"][0]
    m = choice["message"]
    content = [{"type": "thinking", "thinking": m["reasoning"], "signature": ""}] if m.get("reasoning") else []
    content += [{"type": "text", "text": m["content"]}] if m.get("content") else []
    for c in m.get("tool_calls") or []:
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
        except ValueError:  # cut off by max_tokens (stop_reason says so): the input is what parsed, nothing
            args = {}
        content.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": args})
    u = chat["usage"]
    return {
        "id": chat["id"].replace("chatcmpl", "msg"),
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": _STOP.get(choice["finish_reason"], "end_turn"),
        "stop_sequence": None,
        "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"]},
    }


async def events(chunks: AsyncIterator[str], model: str) -> AsyncIterator[str]:
    """A streamed chat completion's SSE (with continuous usage) as Anthropic's stream events."""
    block, index, started, usage, stop = None, -1, False, {"prompt_tokens": 0, "completion_tokens": 0}, "end_turn"
    msg_id = oa.new_id("msg")
    async for group in chunks:
        out = []
        for chunk in oa.sse_objects(group):
            usage = chunk.get("usage") or usage
            if not started:
                started = True
                out.append(
                    _event(
                        "message_start",
                        {
                            "message": {
                                "id": msg_id,
                                "type": "message",
                                "role": "assistant",
                                "model": model,
                                "content": [],
                                "stop_reason": None,
                                "stop_sequence": None,
                                "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": 0},
                            }
                        },
                    )
                )
            for choice in chunk.get("choices") or []:
                d = choice.get("delta") or {}
                pieces = [("thinking", d.get("reasoning"))] + [("text", d.get("content"))]
                pieces += [("tool_use", tc) for tc in d.get("tool_calls") or []]
                for kind, value in pieces:
                    if not value:
                        continue
                    new_call = kind == "tool_use" and "id" in value
                    if kind != block or new_call:
                        if block is not None:
                            out.append(_event("content_block_stop", {"index": index}))
                        block, index = kind, index + 1
                        start = (
                            {"type": kind, kind: ""}
                            if kind != "tool_use"
                            else {"type": "tool_use", "id": value["id"], "name": value["function"]["name"], "input": {}}
                        )
                        out.append(_event("content_block_start", {"index": index, "content_block": start}))
                    if kind == "tool_use":
                        delta = {"type": "input_json_delta", "partial_json": value["function"].get("arguments", "")}
                    else:
                        delta = {"type": f"{kind}_delta", kind: value}
                    out.append(_event("content_block_delta", {"index": index, "delta": delta}))
                if choice.get("finish_reason"):
                    stop = _STOP.get(choice["finish_reason"], "end_turn")
        if out:
            yield "".join(out)
    tail = [_event("content_block_stop", {"index": index})] if block is not None else []
    tail.append(
        _event(
            "message_delta",
            {
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": usage["completion_tokens"]},
            },
        )
    )
    tail.append(_event("message_stop", {}))
    yield "".join(tail)


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def error_body(fields: dict, status: int) -> dict:
    """An OpenAI-shaped error's fields as Anthropic's error object."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": fields["message"]}}
