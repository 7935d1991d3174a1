"""Native jobs (worker-vllm's classic input: prompt or messages, sampling_params): their chunks and final output.

A chunk: {"choices": [{"tokens": [text pieces]}], "usage": {"input", "output"}}, worker-vllm's shape. With
sampling_params.logprobs each choice also has "token_ids" and "logprobs" (one {token id: logprob} per token, the
sampled token always in it: vLLM's offline semantics, as "prompt_logprobs" in the final chunk).

use_openai_format: as_openai turns the job into a /v1/chat/completions input, which the Worker routes."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from engine import LoRARequest, RequestOutput, SamplingParams
from handler import jobs
from handler.guided import FIELDS as GUIDED_FIELDS
from handler.guided import structured_params
from handler.jobs import JobContext
from handler.messages import for_template, pick_template
from handler.pacing import BatchSizer
from handler.schemas import DEFAULT_MAX_TOKENS, JobError, NativeJob, parse, sampling_params, warn_ignored

CHAT = "/v1/chat/completions"


def parse_job(inp: Any) -> NativeJob:
    """The job's input, validated; ignored fields logged."""
    job = parse(NativeJob, inp)
    warn_ignored(job, "input")
    for i, m in enumerate(job.messages or []):  # a history message's ignored fields (annotations)
        warn_ignored(m, f"input.messages.{i}")
    return job


async def native_job(ctx: JobContext, job: NativeJob, rid: str) -> AsyncIterator[dict]:
    params, default_max = _params(job)
    where = jobs.Fields("sampling_params.max_tokens")
    valid = jobs.prepare(ctx, await _prompt(ctx, job), params, _lora(job), where)
    outputs = jobs.generate(ctx, valid, rid)
    acc = _Chunks(valid.params.n, valid.params.logprobs is not None)
    async for group in jobs.paced(ctx, outputs, _sizer(ctx, job)) if job.stream else _whole(outputs):
        for out in group:
            acc.add(out)
        if not group[-1].finished:
            yield acc.chunk()
    yield _final(ctx, acc, valid.params, default_max)


def as_openai(ctx: JobContext, job: NativeJob) -> tuple[dict, LoRARequest | None, BatchSizer]:
    """use_openai_format: the job as a /v1/chat/completions input, with its adapter and its own batch sizes. Its
    sampling fields are checked first, so their errors name the native fields."""
    _params(job)
    return {"openai_route": CHAT, "openai_input": _chat_body(job)}, _lora(job), _sizer(ctx, job)


def native_path(path: str) -> str:
    """A path in _chat_body's body -> the same field's path in the native job."""
    head = path.split(".", 1)[0]
    if head in ("messages", "stream"):
        return path
    return "sampling_params.logprobs" if head in ("logprobs", "top_logprobs") else f"sampling_params.{path}"


def _params(job: NativeJob) -> tuple[SamplingParams, bool]:
    """The job's SamplingParams, and whether max_tokens was left to the default."""
    sp = job.sampling_params.model_dump()
    default_max = sp["max_tokens"] is None
    if default_max:
        sp["max_tokens"] = DEFAULT_MAX_TOKENS
    sp["structured_outputs"] = structured_params({f: sp.pop(f) for f in GUIDED_FIELDS}, "sampling_params")
    return sampling_params(sp, "sampling_params"), default_max


def _lora(job: NativeJob) -> LoRARequest | None:
    if job.lora is None:
        return None
    return LoRARequest(job.lora) if isinstance(job.lora, str) else LoRARequest(job.lora.name, job.lora.s3_uri)


def _sizer(ctx: JobContext, job: NativeJob) -> BatchSizer:
    return jobs.sizer(ctx, job.min_batch_size, job.batch_size_growth_factor, job.max_batch_size)


def _chat_body(job: NativeJob) -> dict:
    """use_openai_format: the job as a /v1/chat/completions body; logprobs become OpenAI's logprobs +
    top_logprobs, prompt_logprobs vLLM's chat extra (a whole response only, as vLLM)."""
    if not job.messages:
        raise JobError("use_openai_format needs messages", param="messages")
    sp = job.sampling_params.model_dump(exclude_unset=True)
    top, prompt_top = sp.pop("logprobs", None), sp.get("prompt_logprobs")
    if prompt_top is not None and job.stream:
        raise JobError(
            "sampling_params.prompt_logprobs with use_openai_format needs stream: false (OpenAI chunks have no "
            "place for them, as in vLLM)",
            param="sampling_params.prompt_logprobs",
        )
    body = {"messages": [m.model_dump(exclude_none=True) for m in job.messages], "stream": job.stream, **sp}
    if top is not None:
        body |= {"logprobs": True, "top_logprobs": top}
    body.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    return body


async def _prompt(ctx: JobContext, job: NativeJob) -> str:
    if job.messages:  # OpenAI's message shapes, readied for the template as on the chat route (handler/messages.py)
        template = pick_template(ctx.engine.tok.chat_template, ctx.settings.CUSTOM_CHAT_TEMPLATE, None)
        history = for_template([m.model_dump(exclude_none=True) for m in job.messages], template)
        return await jobs.chat_prompt(ctx, history, "messages")
    if job.prompt is None or job.prompt == "":
        raise JobError("give a non-empty prompt or messages", param="prompt")
    if job.apply_chat_template:
        return await jobs.chat_prompt(ctx, [{"role": "user", "content": job.prompt}], "prompt")
    return job.prompt


async def _whole(gen) -> AsyncIterator[list]:
    """A non-streamed job's outputs as one group (paced()'s shape)."""
    yield [out async for out in gen]


class _Chunks:
    """What the next chunk carries: each choice's text pieces (with logprobs: token ids and {token id: logprob})
    since the last chunk; and the totals the final chunk reports."""

    def __init__(self, n: int, logprobs: bool):
        self.n, self.logprobs = n, logprobs
        self.n_input = self.n_output = 0
        self.finish: list[str | None] = [None] * n
        self.metrics, self.prompt_logprobs = None, None
        self._clear()

    def _clear(self) -> None:
        self.pending: list[list[str]] = [[] for _ in range(self.n)]
        self.ids: list[list[int]] = [[] for _ in range(self.n)]
        self.lps: list[list[dict]] = [[] for _ in range(self.n)]

    def add(self, out: RequestOutput) -> None:
        self.n_input, self.metrics, self.prompt_logprobs = len(out.prompt_token_ids), out.metrics, out.prompt_logprobs
        for c in out.outputs:
            if c.delta_text:
                self.pending[c.index].append(c.delta_text)
            if self.logprobs and c.delta_token_ids:
                self.ids[c.index] += c.delta_token_ids
                self.lps[c.index] += (c.logprobs or [])[-len(c.delta_token_ids) :]
            self.n_output += len(c.delta_token_ids)
            self.finish[c.index] = c.finish_reason

    def chunk(self, final: bool = False) -> dict:
        choices = [{"tokens": p} for p in self.pending]
        if self.logprobs:
            for c, i, lp in zip(choices, self.ids, self.lps):
                c["token_ids"], c["logprobs"] = i, lp
        if final:
            for c, f in zip(choices, self.finish):
                c["finish_reason"] = f
        self._clear()
        return {"choices": choices, "usage": {"input": self.n_input, "output": self.n_output}}


def _final(ctx: JobContext, acc: _Chunks, params: SamplingParams, default_max: bool) -> dict:
    """The last chunk: the rest of the text, finish reasons, and worker-vllm's usage, extended (metrics)."""
    final = acc.chunk(final=True)
    if acc.metrics is not None:
        final["usage"]["cached_input"] = acc.metrics.cached_prompt_tokens
        final["metrics"] = {
            k: round(v, 6) if isinstance(v, float) else v for k, v in dataclasses.asdict(acc.metrics).items()
        }
        if (cold := jobs.cold_start(ctx)) is not None:
            final["metrics"]["cold_start"] = cold
    if params.prompt_logprobs is not None:  # vLLM's: per prompt token {token id: logprob}, the first null
        final["prompt_logprobs"] = acc.prompt_logprobs
    final["max_tokens"] = params.max_tokens
    if default_max:
        final["note"] = f"sampling_params.max_tokens not given; used the default {DEFAULT_MAX_TOKENS}"
    return final
