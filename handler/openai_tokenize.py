"""vLLM's /tokenize and /detokenize, so benchmark clients can count tokens as the worker does: a prompt, or chat
messages rendered through the same chat template as /v1/chat/completions, to token ids (and their strings); token
ids back to text."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from handler import openai_extras as extras
from handler.jobs import JobContext
from handler.schemas import ChatCompletionRequest, JobError, Message, _Strict, parse

TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"


class TokenizeRequest(_Strict):
    """vLLM's two forms: `prompt` (a completion's), or `messages` (a chat's, with its template's arguments)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


async def tokenize(ctx: JobContext, body: Any, where: str) -> dict:
    req = parse(TokenizeRequest, body, where)
    _check_model(ctx, req.model)
    if req.prompt is not None:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        ids = ctx.engine.tok.encode(req.prompt, add_special_tokens=add)
    else:
        chat = ChatCompletionRequest(
            messages=req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
            tools=req.tools,
            add_special_tokens=bool(req.add_special_tokens),
        )
        ids = (await extras.chat_prompt(ctx, chat, None))[0]["prompt_token_ids"]
    strs = [ctx.engine.tok.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(ctx: JobContext, body: Any, where: str) -> dict:
    req = parse(DetokenizeRequest, body, where)
    _check_model(ctx, req.model)
    vocab = ctx.engine.tok.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise JobError(f"token id {t} is not in the vocabulary (0..{vocab - 1})", param=f"{where}.tokens.{i}")
    return {"prompt": ctx.engine.tok.decode(req.tokens, skip_special_tokens=False)}


def _check_model(ctx: JobContext, model: str | None) -> None:
    if model is not None and model != ctx.served_name and model not in ctx.engine.lora_names():
        raise JobError(f"model {model!r} is not served here; use {ctx.served_name!r}", param="model",
                       type="not_found_error", code="model_not_found")  # fmt: skip
