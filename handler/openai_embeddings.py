"""OpenAI's /v1/embeddings, on whatever model this worker loaded: an embedding model (Qwen3-Embedding and other
decoders trained for it) or the chat model itself. Each input is one engine request that runs its prompt's prefill
through the same scheduler as generation, batched with it, keeps no KV and samples nothing (engine/pooling.py).

How it pools: POOLING and NORMALIZE, else the checkpoint's sentence-transformers files, else the last token,
normalized (vLLM's default for a decoder). `dimensions` keeps the first k values of a Matryoshka model's vector
(config.json's `is_matryoshka` / `matryoshka_dimensions`, or IS_MATRYOSHKA) and is refused for any other model, as
vLLM refuses it: a plain model's truncated vector is a poor embedding."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from engine import InvalidRequestError, LoRARequest, PoolingParams, SamplingParams
from handler import jobs
from handler import openai_extras as extras
from handler.jobs import JobContext
from handler.schemas import ChatCompletionRequest, JobError, Message, _Strict, parse, warn_ignored

EMBEDDINGS = "/v1/embeddings"


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None  # OpenAI's four forms (completions' prompt)
    # vLLM's chat form (worker-vllm's EmbeddingChatRequest): one input, the messages rendered by the chat template
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes (the openai SDK's)
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # IGNORED_FIELDS
    # vLLM's extras
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the last k tokens; -1: all that fit
    normalize: bool | None = None  # this request's; default: NORMALIZE or the model's

    @model_validator(mode="after")
    def _one_form(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of input and messages")
        return self


async def embeddings(ctx: JobContext, body: Any, rid: str, where: str) -> dict:
    req = parse(EmbeddingRequest, body, where)
    warn_ignored(req, where)
    lora = _adapter(ctx, req.model)
    params = SamplingParams(max_tokens=1, pooling=_pooling(ctx, req, where))
    inputs = _inputs(req.input, where) if req.messages is None else [await _chat_ids(ctx, req)]
    valid = [_valid(ctx, req, x, params, lora, f"{where}.input" + (f".{i}" if len(inputs) > 1 else ""))
             for i, x in enumerate(inputs)]  # fmt: skip

    async def one(i: int, v):
        last = None
        async for out in jobs.generate(ctx, v, f"{rid}-{i}"):
            last = out
        if last is None or last.error is not None or last.embedding is None:
            raise (last.error if last is not None and last.error else RuntimeError("the embedding did not finish"))
        return last.embedding

    async with asyncio.TaskGroup() as tg:  # one failure cancels the rest (each frees its blocks)
        tasks = [tg.create_task(one(i, v)) for i, v in enumerate(valid)]
    n = sum(len(v.prompt_token_ids) for v in valid)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(t.result(), req.encoding_format)}
            for i, t in enumerate(tasks)]  # fmt: skip
    usage = {"prompt_tokens": n, "total_tokens": n}
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": req.model or ctx.served_name, "data": data, "usage": usage}  # fmt: skip


async def _chat_ids(ctx: JobContext, req: EmbeddingRequest) -> list[int]:
    """The messages rendered as the chat route renders them (its template, its checks), as token ids."""
    chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                 chat_template_kwargs=req.chat_template_kwargs)  # fmt: skip
    return (await extras.chat_prompt(ctx, chat, None))[0]["prompt_token_ids"]


def _pooling(ctx: JobContext, req: EmbeddingRequest, where: str) -> PoolingParams:
    s, model = ctx.settings, ctx.engine.model_pooling
    normalize = next(x for x in (req.normalize, s.NORMALIZE, model.normalize) if x is not None)
    if (k := req.dimensions) is not None:
        allowed = model.matryoshka if s.IS_MATRYOSHKA is None else s.IS_MATRYOSHKA
        field, hidden = f"{where}.dimensions", ctx.engine.hidden_size
        if not allowed:
            raise JobError("this model is not a Matryoshka model: a truncated vector would be a poor embedding (set "
                           "IS_MATRYOSHKA=true if it was trained for it)", param=field)  # fmt: skip
        if k > hidden or (isinstance(allowed, list) and k not in allowed):
            sizes = allowed if isinstance(allowed, list) else f"1..{hidden}"
            raise JobError(f"dimensions={k} is not one this model gives: {sizes}", param=field)
        k = None if k == hidden else k
    return PoolingParams(s.POOLING or model.pooling, normalize, k)


def _inputs(x, where: str) -> list:
    """The inputs, each a text or token ids."""
    if isinstance(x, str) or (isinstance(x, list) and x and isinstance(x[0], int)):
        return [x]
    if not x:
        raise JobError("input is empty: give a string, a list of strings, or token ids", param=f"{where}.input")
    return list(x)


def _valid(ctx: JobContext, req: EmbeddingRequest, x, params, lora, field: str):
    try:
        ids = ctx.engine.tok.encode(x, add_special_tokens=req.add_special_tokens) if isinstance(x, str) else list(x)
        if (k := req.truncate_prompt_tokens) is not None and ids:
            ids = ids[-(ctx.engine.max_model_len if k == -1 else max(k, 1)) :]
        return ctx.engine.validate({"prompt_token_ids": ids}, params, lora)
    except InvalidRequestError as e:
        head = (e.field or "").split(".")[0]
        if head == "lora":
            raise JobError(f"model {req.model!r}: {e}", param="model", type="not_found_error",
                           code="model_not_found") from None  # fmt: skip
        raise JobError(str(e).replace("the prompt", "the input"), param=field) from None
    except UnicodeEncodeError as e:  # a lone UTF-16 surrogate from a JSON escape
        raise JobError(f"the input is not valid Unicode text: {e.reason}", param=field) from None


def _adapter(ctx: JobContext, model: str | None) -> LoRARequest | None:
    """None (the base model), or the adapter `model` names (vLLM's multi-LoRA serving)."""
    if model is None or model == ctx.served_name:
        return None
    if not ctx.settings.ENABLE_LORA:
        raise JobError(f"model {model!r} is not served here; use {ctx.served_name!r}", param="model",
                       type="not_found_error", code="model_not_found")  # fmt: skip
    return LoRARequest(model)


def _encoded(v: list[float], fmt: str) -> list[float] | str:
    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() if fmt == "base64" else v
