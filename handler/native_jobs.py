"""Native jobs (worker-vllm's classic input: prompt or messages, sampling_params): their chunks and final output.

A chunk: {"choices": [{"tokens": [text pieces]}], "usage": {"input", "output"}}, worker-vllm's shape. With
sampling_params.logprobs each choice also has "token_ids" and "logprobs" (one {token id: logprob} per token, the
sampled token always in it: vLLM's offline semantics, as "prompt_logprobs" in the final chunk)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from engine import LoRARequest
from handler.guided import FIELDS as GUIDED_FIELDS
from handler.guided import structured_params
from handler.messages import for_template, pick_template
from handler.openai_jobs import openai_job
from handler.pacing import BatchSizer
from handler.schemas import DEFAULT_MAX_TOKENS, JobError, NativeJob, parse, sampling_params, warn_ignored

if TYPE_CHECKING:
    from handler.worker import Worker


async def native_job(w: Worker, inp: Any, rid: str) -> AsyncIterator[dict]:
    job = parse(NativeJob, inp)
    warn_ignored(job, "input")
    for i, m in enumerate(job.messages or []):  # a history message's ignored fields (annotations)
        warn_ignored(m, f"input.messages.{i}")
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
    s = w.settings
    sizer = BatchSizer(
        job.min_batch_size or s.DEFAULT_MIN_BATCH_SIZE,
        job.batch_size_growth_factor or s.DEFAULT_BATCH_SIZE_GROWTH_FACTOR,
        job.max_batch_size or s.DEFAULT_BATCH_SIZE,
    )
    if job.use_openai_format:
        body = _chat_body(job)
        try:
            async for chunk in openai_job(
                w, {"openai_route": "/v1/chat/completions", "openai_input": body}, rid, lora, sizer
            ):
                yield chunk
        except JobError as e:  # the body was built from this job: name its fields as the job has them
            raise e.rebased("openai_input", _native_path) from None
        return
    prompt, params = w.fit(await _prompt(w, job), params, "sampling_params.max_tokens")
    n, lps_on = params.n, params.logprobs is not None
    pending: list[list[str]] = [[] for _ in range(n)]
    ids: list[list[int]] = [[] for _ in range(n)]  # with logprobs: this chunk's token ids and their logprobs
    lps: list[list[dict]] = [[] for _ in range(n)]
    out_tokens, finish, n_input, metrics, prompt_lps = 0, [None] * n, 0, None, None
    cold: list = []
    gen = w.generate(prompt, params, rid, lora, cold)
    async for group in w.paced(gen, sizer) if job.stream else _whole(gen):
        for out in group:
            n_input, metrics, prompt_lps = len(out.prompt_token_ids), out.metrics, out.prompt_logprobs
            for c in out.outputs:
                if c.delta_text:
                    pending[c.index].append(c.delta_text)
                if lps_on and c.delta_token_ids:
                    ids[c.index] += c.delta_token_ids
                    lps[c.index] += (c.logprobs or [])[-len(c.delta_token_ids) :]
                out_tokens += len(c.delta_token_ids)
                finish[c.index] = c.finish_reason
        if not group[-1].finished:
            yield _chunk(pending, n_input, out_tokens, logprobs=(ids, lps) if lps_on else None)
            pending, ids, lps = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
    final = _chunk(pending, n_input, out_tokens, finish, (ids, lps) if lps_on else None)
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


def _native_path(path: str) -> str:
    """A path in _chat_body's body -> the same field's path in the native job."""
    head = path.split(".", 1)[0]
    if head in ("messages", "stream"):
        return path
    return "sampling_params.logprobs" if head in ("logprobs", "top_logprobs") else f"sampling_params.{path}"


async def _prompt(w: Worker, job: NativeJob) -> str:
    if job.messages:  # OpenAI's message shapes, readied for the template as on the chat route (handler/messages.py)
        template = pick_template(w.engine.tok.chat_template, w.settings.CUSTOM_CHAT_TEMPLATE, None)
        history = for_template([m.model_dump(exclude_none=True) for m in job.messages], template)
        return await w.chat_prompt(history, "messages")
    if job.prompt is None or job.prompt == "":
        raise JobError("give a non-empty prompt or messages", param="prompt")
    if job.apply_chat_template:
        return await w.chat_prompt([{"role": "user", "content": job.prompt}], "prompt")
    return job.prompt


async def _whole(gen) -> AsyncIterator[list]:
    """A non-streamed job's outputs as one group (paced()'s shape)."""
    yield [out async for out in gen]


def _chunk(pending: list[list[str]], n_input: int, n_output: int, finish=None, logprobs=None) -> dict:
    choices = [{"tokens": p} for p in pending]
    if logprobs is not None:
        for c, i, lp in zip(choices, *logprobs):
            c["token_ids"], c["logprobs"] = i, lp
    if finish is not None:
        for c, f in zip(choices, finish):
            c["finish_reason"] = f
    return {"choices": choices, "usage": {"input": n_input, "output": n_output}}
