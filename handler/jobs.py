"""What every job uses besides its own route: the JobContext the Worker hands it, the chat prompt, a request's one
validation with the context-room rule, its engine stream, and the stream's pacing.

Job modules (native_jobs, openai_jobs, openai_completions, openai_extras) import this and never the Worker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine import AsyncEngine, InvalidRequestError, LoRARequest, RequestOutput, SamplingParams, Timeline, ValidRequest
from handler.pacing import BatchSizer
from handler.pacing import paced as _paced
from handler.schemas import JobError
from handler.settings import Settings

if TYPE_CHECKING:
    from handler.metrics import Metrics

log = logging.getLogger("handler")

FIRST_TOKEN = "first token"  # the cold-start timeline's last phase


class Gate:
    """Whether the worker still starts engine requests. The Worker closes it, with the error every job then gets,
    when it ends its jobs (shutdown); a job that was not yet in the engine then never gets there."""

    def __init__(self) -> None:
        self.error: JobError | None = None

    def close(self, error: JobError) -> None:
        self.error = error

    def check(self) -> None:
        if self.error is not None:
            raise self.error


class ColdStart:
    """The worker's cold-start timeline, lent to each job until one makes the worker's first token: that job marks
    "first token" and reports the timeline in its final output."""

    def __init__(self, timeline: Timeline):
        self.timeline, self.mine = timeline, False

    async def watch(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        async for out in outputs:
            if not self.mine and any(c.delta_token_ids for c in out.outputs) and not marked(self.timeline):
                self.mine = True
                self.timeline.mark(FIRST_TOKEN)
                log.info("cold start to first token: %.2f s", self.timeline.total())
            yield out

    def report(self) -> dict | None:
        return self.timeline.as_dict() if self.mine else None


def marked(timeline: Timeline) -> bool:
    """Whether some job has made the worker's first token."""
    return any(p.name == FIRST_TOKEN for p in timeline.phases)


@dataclass(frozen=True)
class JobContext:
    """What a job may use of its worker."""

    engine: AsyncEngine  # the public surface: validate, generate, abort, stats, tok, max_model_len, lora_names
    settings: Settings
    served_name: str  # the model name OpenAI routes answer to
    gate: Gate = field(default_factory=Gate)
    cold_start: ColdStart | None = None  # lent until the worker's first token (see ColdStart)
    metrics: Metrics | None = None  # the worker's Prometheus metrics (/metrics): every request's stream is observed


@dataclass(frozen=True)
class Fields:
    """Where a request's parts sit in its job, so that validation errors name the fields its client wrote."""

    max_tokens: str  # the max_tokens field; the other sampling fields sit beside it
    prompt: str | None = None  # the field the prompt came from (None: the engine's name, prompt or prompt_token_ids)
    model: str | None = None  # an OpenAI `model` that named the adapter: its errors are OpenAI's model_not_found


def prepare(
    ctx: JobContext,
    prompt: str | dict,
    params: SamplingParams,
    lora: LoRARequest | None,
    where: Fields,
    default_room: bool = False,
) -> ValidRequest:
    """The engine's validation, once, then the context rule: a max_tokens the context cannot hold is an error (as in
    vLLM's OpenAI server); default_room (no max_tokens on an OpenAI route) takes all the room left."""
    try:
        valid = ctx.engine.validate(prompt, params, lora)
        room = ctx.engine.max_model_len - len(valid.prompt_token_ids)
        if default_room:
            return replace(valid, params=replace(valid.params, max_tokens=room))
    except InvalidRequestError as e:
        raise _named(e, where) from None
    if valid.params.max_tokens > room:
        raise JobError(
            f"max_tokens={valid.params.max_tokens} does not fit: the prompt has {len(valid.prompt_token_ids)} tokens "
            f"and the context is {ctx.engine.max_model_len}, leaving room for {room}",
            param=where.max_tokens,
            code="context_length_exceeded",  # OpenAI's code for it
        )
    return valid


def _named(e: InvalidRequestError, where: Fields) -> Exception:
    """An engine validation error as the job's: the prompt's, the adapter's or a sampling field's."""
    head = (e.field or "").split(".")[0]
    if head in ("prompt", "prompt_token_ids"):
        return JobError(str(e), param=where.prompt or e.field)
    if head == "lora":  # a native job's lora field keeps its name (the Worker reports e.field)
        if where.model is None:
            return e
        return JobError(
            f"model {where.model!r}: {e}", param="model", type="not_found_error", code="model_not_found"
        )  # OpenAI's code
    return JobError(str(e), param=f"{where.max_tokens.rsplit('.', 1)[0]}.{e.field}")


async def generate(ctx: JobContext, valid: ValidRequest, rid: str) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request, unless the worker has stopped taking work; watched by the worker's
    metrics and its cold start where it has them."""
    ctx.gate.check()
    outputs = ctx.engine.generate(valid, request_id=rid)
    if ctx.metrics is not None:
        outputs = ctx.metrics.watch(outputs)
    async for out in outputs if ctx.cold_start is None else ctx.cold_start.watch(outputs):
        yield out


def cold_start(ctx: JobContext) -> dict | None:
    """The cold-start timeline, for the final output of the job that made the worker's first token."""
    return ctx.cold_start.report() if ctx.cold_start is not None else None


def sizer(ctx: JobContext, min_size: int | None = None, growth: float | None = None, max_size: int | None = None):
    """A stream's tokens per yield: the job's own sizes where it sets them, else the worker's settings."""
    s = ctx.settings
    return BatchSizer(
        min_size or s.DEFAULT_MIN_BATCH_SIZE,
        growth or s.DEFAULT_BATCH_SIZE_GROWTH_FACTOR,
        max_size or s.DEFAULT_BATCH_SIZE,
    )


def paced(ctx: JobContext, outputs: AsyncIterator, sizer: BatchSizer) -> AsyncIterator[list]:
    return _paced(outputs, sizer, ctx.settings.STREAM_FLUSH_MS / 1000)


async def chat_prompt(
    ctx: JobContext,
    messages: list[dict],
    param: str,
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
) -> str:
    """Rendered on a thread: a template that only transformers can render loads its tokenizer on first use,
    which must not stall the other jobs' streams. template_kwargs: the request's chat_template_kwargs;
    chat_template: the request's own template (vLLM's chat_template field) over CUSTOM_CHAT_TEMPLATE's."""
    kw = dict(template_kwargs or {})
    taken = sorted(kw.keys() & _RESERVED_TEMPLATE_KWARGS)
    if taken:
        raise JobError(
            f"chat_template_kwargs may not set {taken}: the request sets them",
            param=f"openai_input.chat_template_kwargs.{taken[0]}",
        )
    try:
        return await asyncio.to_thread(
            ctx.engine.tok.apply_chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template or ctx.settings.CUSTOM_CHAT_TEMPLATE,
            tools=tools,
            **kw,
        )
    except Exception as e:  # jinja errors from a template the messages do not fit
        raise JobError(f"{param}: the chat template rejected these messages: {e}", param=param) from None


# apply_chat_template's own arguments, which the request sets: a template kwarg cannot override them
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "add_generation_prompt", "chat_template", "tokenize", "tools"}
)
