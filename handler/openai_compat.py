"""OpenAI response shapes: chat.completion(.chunk), text_completion, models list, logprobs, SSE framing."""

from __future__ import annotations

import json
import time
import uuid


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


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

    def __init__(self, model: str):
        self.id, self.model, self.created = new_id("chatcmpl"), model, int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, index: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
        return {
            **self._head(self.object_chunk),
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        }

    def usage_chunk(self, u: dict) -> dict:
        return {**self._head(self.object_chunk), "choices": [], "usage": u}

    def full(self, choices: list[dict], u: dict) -> dict:
        return {
            **self._head(self.object_full),
            "choices": [
                {
                    "index": c["index"],
                    "message": {"role": "assistant", "content": c["text"]}
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

    def __init__(self, model: str):
        super().__init__(model)
        self.id = new_id("cmpl")

    def chunk(self, index: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
        return {
            **self._head(self.object_chunk),
            "choices": [
                {"index": index, "text": delta.get("content", ""), "logprobs": logprobs, "finish_reason": finish_reason}
            ],
        }

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
