"""/v1/completions after validation: one prompt or a batch of them (OpenAI's four `prompt` forms), each prompt its
own engine request, all added at once so the scheduler runs them together. Choices are numbered
prompt_index * n + i, as OpenAI and vLLM number them; usage sums over the batch; a stream ends once, after every
prompt has finished. max_tokens=0 with echo scores the prompt: its tokens and logprobs, nothing generated.

Limits: n is checked per prompt (n sequences of one prompt must fit one batch: max_num_seqs). The prompts of a batch
are independent requests that queue like concurrent jobs, so a batch may hold more sequences than max_num_seqs
in all, as in vLLM (lm-eval-harness's batch_size 16 must work on a worker with MAX_NUM_SEQS=8)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from handler import jobs
from handler import openai_compat as oa
from handler import openai_extras as extras
from handler.jobs import JobContext
from handler.pacing import BatchSizer
from handler.schemas import CompletionRequest, JobError

if TYPE_CHECKING:
    from engine import LoRARequest, RequestOutput, SamplingParams, ValidRequest

WHERE = "openai_input"  # the job field the request body sits in (errors name paths under it)


def check(req: CompletionRequest) -> None:
    """What the schema's per-field checks cannot see: max_tokens=0 is scoring, which only echo makes useful."""
    if req.max_tokens == 0 and not req.echo:
        raise JobError(
            "max_tokens=0 generates nothing and, without echo, returns nothing: set echo to score the prompt, or "
            "max_tokens >= 1",
            param=f"{WHERE}.max_tokens",
        )
    if req.max_tokens == 0 and req.min_tokens:
        raise JobError(f"min_tokens={req.min_tokens} cannot hold with max_tokens=0", param=f"{WHERE}.min_tokens")


def _prompts(req: CompletionRequest) -> tuple[list[str | dict], bool]:
    """The engine prompts, and whether `prompt` was a list of prompts (then errors name prompt.<i>)."""
    p = req.prompt
    if isinstance(p, str):
        return [p], False
    if isinstance(p[0], int):
        return [{"prompt_token_ids": p}], False
    return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p], True


@dataclass
class _Part:
    """One prompt's engine output in a batch's merged stream, in the shape pacing.paced() reads: `outputs` (their
    new tokens count toward a yield) and `finished` (true only on the batch's last output: the stream's end)."""

    prompt: int
    out: RequestOutput
    finished: bool

    @property
    def outputs(self):
        return self.out.outputs


async def _merged(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[_Part]:
    """The outputs of every prompt's request as they come. Leaving early (a consumer's close or cancel) or an error
    in one request closes them all, which aborts the requests still running; their aborts are queued to the engine
    before this returns, so a job's cancel (which then aborts its own id and waits) finds them freed."""
    pulls = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens)}
    left = len(gens)
    try:
        while pulls:
            done, _ = await asyncio.wait(pulls, return_when=asyncio.FIRST_COMPLETED)
            for f in sorted(done, key=pulls.__getitem__):  # prompt order within one wake-up
                i = pulls.pop(f)
                try:
                    out = f.result()
                except StopAsyncIteration:  # ended without a finished output (aborted)
                    left -= 1
                    continue
                if out.finished:
                    left -= 1
                else:
                    pulls[asyncio.ensure_future(anext(gens[i]))] = i
                yield _Part(i, out, left == 0)
    finally:
        for f in pulls:
            if f.done() and not f.cancelled():
                f.exception()  # retrieved: an error after the first one raised is not logged as lost
            f.cancel()  # CancelledError inside that request's generate(): it aborts the request
        if pulls:
            await asyncio.wait(pulls)
        for g in gens:
            await g.aclose()


async def job(
    ctx: JobContext,
    req: CompletionRequest,
    params: SamplingParams,
    rid: str,
    lora: LoRARequest | None,
    shapes: oa.CompletionShapes,
    sizer: BatchSizer,
) -> AsyncIterator[Any]:
    """params: the request's sampling parameters (max_tokens 1 when scoring: one token is generated and dropped,
    as vLLM does, so prompt logprobs come from the same prefill path as always); lora: the adapter `model` names;
    rid: the job's engine request id, used by prompt 0 (the worker aborts it on cancel), prompt i > 0 runs as
    "{rid}/{i}"."""
    prompts, batched = _prompts(req)
    valid = [_prepare(ctx, req, params, lora, prompt, i if batched else None) for i, prompt in enumerate(prompts)]
    parts = _merged([jobs.generate(ctx, v, rid if i == 0 else f"{rid}/{i}") for i, v in enumerate(valid)])
    view = _View(ctx, req)
    n_in = sum(len(v.prompt_token_ids) for v in valid)
    if req.stream:
        async for chunk in _stream(ctx, req, parts, shapes, view, n_in, sizer):
            yield chunk
    else:
        yield await _whole(ctx, req, parts, shapes, view, n_in)


async def _whole(ctx: JobContext, req: CompletionRequest, parts, shapes, view: _View, n_in: int) -> dict:
    """The batch's completions in one response."""
    finals: dict[int, RequestOutput] = {}
    async for part in parts:
        if part.out.finished:
            finals[part.prompt] = part.out
    choices, n_out, cached = [], 0, 0
    for p, out in sorted(finals.items()):
        cached += out.metrics.cached_prompt_tokens
        for c in out.outputs:
            ids = [] if view.scoring else c.token_ids
            n_out += len(ids)
            text, lp = view.piece(p, out, c.text, ids, c.logprobs, req.echo)
            choices.append(
                {"index": p * req.n + c.index, "text": text, "finish_reason": view.finish(c), "logprobs": lp}
                | {"prompt_logprobs": out.prompt_logprobs, "prompt_token_ids": out.prompt_token_ids, "token_ids": ids}
            )
    full = shapes.full(choices, oa.usage(n_in, n_out, cached))
    extras.completion_extras(req, full, choices)  # prompt_logprobs, return_token_ids
    if (cold := jobs.cold_start(ctx)) is not None:
        full["metrics"] = {"cold_start": cold}  # an extension field; OpenAI clients ignore it
    return full


def _prepare(ctx: JobContext, req: CompletionRequest, params, lora, prompt, i: int | None) -> ValidRequest:
    """Prompt i of a batch (None: the only prompt) as the engine's request, its max_tokens left to the room when the
    request sets none."""
    param = f"{WHERE}.prompt" + (f".{i}" if i is not None else "")
    prompt = extras.prompt_ids(ctx, req, prompt, param, req.max_tokens)  # add_special_tokens, truncate_prompt_tokens
    where = jobs.Fields(f"{WHERE}.max_tokens", param, req.model if lora is not None else None)
    try:
        return jobs.prepare(ctx, prompt, params, lora, where, default_room=req.max_tokens is None)
    except JobError as e:  # a max_tokens that does not fit: say which prompt it does not fit
        if i is not None and e.param == where.max_tokens:
            raise JobError(f"prompt {i}: {e.message}", param=e.param, type=e.type, code=e.code) from None
        raise


class _View:
    """How a choice's text and logprobs look: echo puts the prompt's first, and scoring drops the one token
    generated (finish_reason "length": max_tokens=0 was reached)."""

    def __init__(self, ctx: JobContext, req: CompletionRequest):
        self.tok, self.top_n, self.scoring = ctx.engine.tok, req.logprobs, req.max_tokens == 0
        self.names = extras.token_names(ctx, req)  # what names logprobs' tokens (return_tokens_as_token_ids)
        self._prompt_text: dict[int, str] = {}

    def finish(self, c) -> str | None:
        return ("length" if c.finish_reason else None) if self.scoring else c.finish_reason

    def piece(self, p: int, out, text: str, ids: list[int], lps, echo: bool, offset: int = 0):
        """(text, logprobs or None) for these generated tokens of a choice of prompt p; echo: the prompt first,
        its first token's logprob null (nothing predicts it), as OpenAI's legacy API and vLLM give it."""
        if self.scoring:
            text, ids, lps = "", [], []
        lps = list(lps or [])[-len(ids) :] if ids else []
        if echo:
            if p not in self._prompt_text:
                self._prompt_text[p] = self.tok.decode(out.prompt_token_ids, skip_special_tokens=False)
            text = self._prompt_text[p] + text
            ids = list(out.prompt_token_ids) + ids
            lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + lps
        if self.top_n is None or not ids:
            return text, None
        return text, oa.completion_logprobs(self.names, ids, lps, self.top_n, offset)


async def _stream(
    ctx: JobContext, req: CompletionRequest, parts, shapes, view: _View, n_in: int, sizer: BatchSizer
) -> AsyncIterator[str]:
    each_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    events: list[str] = []
    n_out = cached = 0
    offsets: dict[int, int] = {}  # choice index -> the text_offset its next logprobs start at
    ids_due = extras.TokenIdsDue(bool(req.return_token_ids))

    def event(obj: dict) -> str:  # continuous_usage_stats: vLLM's running usage (here of the whole batch)
        obj = ids_due.attach(obj)
        return oa.sse(obj | {"usage": oa.usage(n_in, n_out, cached)} if each_usage else obj)

    async for group in jobs.paced(ctx, parts, sizer):
        for part in group:
            out = part.out
            if out.finished:
                cached += out.metrics.cached_prompt_tokens
            for c in out.outputs:
                if not (c.delta_text or c.finish_reason or c.delta_token_ids):
                    continue
                index = part.prompt * req.n + c.index
                ids = [] if view.scoring else c.delta_token_ids
                n_out += len(ids)
                ids_due.add(index, ids, out.prompt_token_ids)
                echo = req.echo and index not in offsets  # the prompt goes out in the choice's first chunk
                text, lp = view.piece(part.prompt, out, c.delta_text, ids, c.logprobs, echo, offsets.get(index, 0))
                offsets.setdefault(index, 0)
                if lp is not None and lp["tokens"]:
                    offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                if text or lp is not None:
                    events.append(event(shapes.chunk(index, {"content": text}, None, lp)))
                if finish := view.finish(c):
                    events.append(event(shapes.chunk(index, {}, finish)))
        if events and not group[-1].finished:
            yield "".join(events)
            events = []
    yield oa.stream_end(events, shapes, req, oa.usage(n_in, n_out, cached))
