"""Native jobs (worker-vllm's classic input: prompt or messages, sampling_params): their chunks and final output."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from engine import LoRARequest
from handler.guided import FIELDS as GUIDED_FIELDS
from handler.guided import structured_params
from handler.openai_jobs import openai_job
from handler.pacing import BatchSizer
from handler.schemas import DEFAULT_MAX_TOKENS, JobError, NativeJob, parse, sampling_params

if TYPE_CHECKING:
    from handler.worker import Worker


async def native_job(w: Worker, inp: Any, rid: str) -> AsyncIterator[dict]:
    job = parse(NativeJob, inp)
    sp = job.sampling_params.model_dump()
    default_max = sp["max_tokens"] is None
    if default_max:
        sp["max_tokens"] = DEFAULT_MAX_TOKENS
    sp["structured_outputs"] = structured_params({f: sp.pop(f) for f in GUIDED_FIELDS}, "sampling_params")
    params = sampling_params(sp, "sampling_params")
    lora = None
    if job.lora is not None:
        lora = LoRARequest(job.lora) if isinstance(job.lora, str) else LoRARequest(job.lora.name, job.lora.s3_uri)
        w.engine.resolve_lora(lora)  # a bad name or bucket is this job's error, before any work
    if job.use_openai_format:
        if not job.messages:
            raise JobError("use_openai_format needs messages", param="messages")
        body = {
            "messages": [m.model_dump(exclude_none=True) for m in job.messages],
            "stream": job.stream,
            **{
                k: v
                for k, v in job.sampling_params.model_dump(exclude_unset=True).items()
                if k not in ("logprobs", "prompt_logprobs")
            },
        }
        body.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
        async for chunk in openai_job(w, {"openai_route": "/v1/chat/completions", "openai_input": body}, rid, lora):
            yield chunk
        return
    prompt, params = w.fit(await _prompt(w, job), params, "sampling_params.max_tokens")
    s = w.settings
    sizer = BatchSizer(
        job.min_batch_size or s.DEFAULT_MIN_BATCH_SIZE,
        job.batch_size_growth_factor or s.DEFAULT_BATCH_SIZE_GROWTH_FACTOR,
        job.max_batch_size or s.DEFAULT_BATCH_SIZE,
    )
    n = params.n
    pending: list[list[str]] = [[] for _ in range(n)]
    out_tokens, finish, n_input, metrics, prompt_lps = 0, [None] * n, 0, None, None
    cold: list = []
    gen = w.generate(prompt, params, rid, lora, cold)
    async for group in w.paced(gen, sizer) if job.stream else _whole(gen):
        for out in group:
            n_input, metrics, prompt_lps = len(out.prompt_token_ids), out.metrics, out.prompt_logprobs
            for c in out.outputs:
                if c.delta_text:
                    pending[c.index].append(c.delta_text)
                out_tokens += len(c.delta_token_ids)
                finish[c.index] = c.finish_reason
        if not group[-1].finished:
            yield _chunk(pending, n_input, out_tokens)
            pending = [[] for _ in range(n)]
    final = _chunk(pending, n_input, out_tokens, finish)
    if metrics is not None:  # worker-vllm's usage, extended
        final["usage"]["cached_input"] = metrics.cached_prompt_tokens
        final["metrics"] = {
            k: round(v, 6) if isinstance(v, float) else v for k, v in dataclasses.asdict(metrics).items()
        }
        if cold:
            final["metrics"]["cold_start"] = cold[0]
    if params.prompt_logprobs is not None:  # vLLM's: per prompt token {token id: logprob}, the first null
        final["prompt_logprobs"] = prompt_lps
    final["max_tokens"] = params.max_tokens
    if default_max:
        final["note"] = f"sampling_params.max_tokens not given; used the default {DEFAULT_MAX_TOKENS}"
    yield final


async def _prompt(w: Worker, job: NativeJob) -> str:
    if job.messages:
        return await w.chat_prompt([m.model_dump(exclude_none=True) for m in job.messages], "messages")
    if job.prompt is None or job.prompt == "":
        raise JobError("give a non-empty prompt or messages", param="prompt")
    if job.apply_chat_template:
        return await w.chat_prompt([{"role": "user", "content": job.prompt}], "prompt")
    return job.prompt


async def _whole(gen) -> AsyncIterator[list]:
    """A non-streamed job's outputs as one group (paced()'s shape)."""
    yield [out async for out in gen]


def _chunk(pending: list[list[str]], n_input: int, n_output: int, finish=None) -> dict:
    choices = [{"tokens": p} for p in pending]
    if finish is not None:
        for c, f in zip(choices, finish):
            c["finish_reason"] = f
    return {"choices": choices, "usage": {"input": n_input, "output": n_output}}
