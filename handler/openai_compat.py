"""OpenAI response shapes: chat.completion(.chunk), text_completion, models list, logprobs, SSE framing, and the
error object with the routes it names. Light on purpose: the emulator imports it (no engine, no pydantic)."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import time
import uuid

# The routes an OpenAI job serves (the emulator's /openai prefix forwards exactly these): path -> method
ROUTES = {
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/models": "GET",
    "/v1/embeddings": "POST",  # handler/openai_embeddings.py
    "/tokenize": "POST",  # vLLM's (handler/openai_tokenize.py)
    "/detokenize": "POST",
    "/v1/responses": "POST",  # handler/openai_responses.py
    "/v1/messages": "POST",  # Anthropic's (handler/anthropic_messages.py)
    "/v1/messages/count_tokens": "POST",
}

# Error types by HTTP status, as OpenAI names them (see error()); the status itself travels beside the object
STATUS = {"invalid_request_error": 400, "not_found_error": 404, "server_error": 500}


def error(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}. `param` is a field path in the client's
    own request; `code` a string (OpenAI's where one fits: "unknown_url", "model_not_found", ...) or None, never
    the HTTP status (vLLM puts the status there; OpenAI and its SDK's `e.code` do not)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def route_error(route: str, method: str | None = None) -> tuple[dict, int] | None:
    """None when `method route` is served; else the error fields (error()'s keyword arguments) and HTTP status,
    naming the route and listing those that exist. method None (a queue job's openai_route): any method."""
    served = ", ".join(f"{m} {p}" for p, m in ROUTES.items())
    asked = f"{method} {route}" if method else route
    if route not in ROUTES:
        message = f"Unknown request URL: {asked}. This worker serves: {served}."
        return {"message": message, "type": "not_found_error", "code": "unknown_url"}, 404
    if method is not None and method != ROUTES[route]:
        message = f"{asked} is not allowed: use {ROUTES[route]} {route}. This worker serves: {served}."
        return {"message": message, "type": "invalid_request_error", "code": "method_not_allowed"}, 405
    return None


@functools.lru_cache(maxsize=4)
def system_fingerprint(*config: str | None) -> str:
    """OpenAI's system_fingerprint ("fp_" + 10 hex digits): a hash of the backend configuration that shapes the
    outputs (what the caller passes: model, revision, dtype, quantization) and of this worker's version. Stable for
    one deployment; a change of any of them changes it, which is what clients compare it for."""
    try:
        version = importlib.metadata.version("rp-llm-worker")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        version = "unknown"
    return "fp_" + hashlib.sha256("\n".join(map(str, (*config, version))).encode()).hexdigest()[:10]


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_objects(text: str):
    """The JSON objects of `text`'s SSE events (sse()'s output; [DONE] and other events skipped)."""
    for raw in text.split("\n\n"):
        if raw.startswith("data: {"):
            yield json.loads(raw[6:])


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def models_list(names: list[str]) -> dict:
    now = int(time.time())
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": now, "owned_by": "runpod"} for n in names],
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _token_str(tokenizer, tid: int) -> str:
    return tokenizer.decode([tid], skip_special_tokens=False)


def chat_logprobs(tokenizer, token_ids: list[int], lps: list[dict[int, float]], top_n: int) -> dict:
    """OpenAI chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for tid, d in zip(token_ids, lps):

        def entry(t, lp):
            s = _token_str(tokenizer, t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        top = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**entry(tid, d[tid]), "top_logprobs": [entry(t, lp) for t, lp in top]})
    return {"content": content}


def completion_logprobs(
    tokenizer, token_ids: list[int], lps: list[dict[int, float]], top_n: int, offset: int = 0
) -> dict:
    """Legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(token_ids, lps):
        s = _token_str(tokenizer, tid)
        tokens.append(s)
        if d is None:  # an echoed prompt's first token: nothing predicts it
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(d[tid])
            top = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
            tops.append({_token_str(tokenizer, t): lp for t, lp in top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class ChatShapes:
    """Builds chat.completion objects and chunks for one request."""

    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, fingerprint: str | None = None, include_usage: bool = False):
        """fingerprint: system_fingerprint(); include_usage: stream_options.include_usage, when every chunk but the
        last (usage_chunk) carries "usage": null, as OpenAI's chunk schema has it."""
        self.id, self.model, self.created = new_id("chatcmpl"), model, int(time.time())
        self.fingerprint, self.include_usage = fingerprint, include_usage

    def _head(self, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def _chunk(self, choice: dict) -> dict:
        return {**self._head(self.object_chunk), "choices": [choice]} | ({"usage": None} if self.include_usage else {})

    def chunk(self, index: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
        return self._chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})

    def usage_chunk(self, u: dict) -> dict:
        return {**self._head(self.object_chunk), "choices": [], "usage": u}

    def full(self, choices: list[dict], u: dict) -> dict:
        return {
            **self._head(self.object_full),
            "choices": [
                {
                    "index": c["index"],
                    "message": {"role": "assistant", "content": c["text"]}
                    | ({"reasoning": c["reasoning"], "reasoning_content": c["reasoning"]} if "reasoning" in c else {})
                    | ({"tool_calls": c["tool_calls"]} if c.get("tool_calls") else {}),
                    "logprobs": c.get("logprobs"),
                    "finish_reason": c["finish_reason"],
                }
                for c in choices
            ],
            "usage": u,
        }


class CompletionShapes(ChatShapes):
    object_full = object_chunk = "text_completion"

    def __init__(self, model: str, fingerprint: str | None = None, include_usage: bool = False):
        super().__init__(model, fingerprint, include_usage)
        self.id = new_id("cmpl")

    def chunk(self, index: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
        choice = {
            "index": index,
            "text": delta.get("content", ""),
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return self._chunk(choice)

    def full(self, choices: list[dict], u: dict) -> dict:
        return {
            **self._head(self.object_full),
            "choices": [
                {
                    "index": c["index"],
                    "text": c["text"],
                    "logprobs": c.get("logprobs"),
                    "finish_reason": c["finish_reason"],
                }
                for c in choices
            ],
            "usage": u,
        }


def stream_end(events: list[str], shapes, req, usage: dict) -> str:
    """A stream's last write: the events still pending, the usage chunk (stream_options.include_usage), [DONE]."""
    if req.stream_options and req.stream_options.include_usage:
        events = [*events, sse(shapes.usage_chunk(usage))]
    return "".join([*events, SSE_DONE])
