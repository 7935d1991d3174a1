"""The async generator handler: one job in, chunks out. Native (worker-vllm classic) and OpenAI jobs.

Errors in a job end that job with one error object and never touch other jobs. An engine fault (the step
loop raised) ends every in-flight job with an error and asks Runpod to replace this worker."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
from typing import Any, AsyncIterator

from engine import AsyncEngine, EngineError, EngineFault, InvalidRequestError, LoRARequest, SamplingParams, Timeline
from handler import openai_compat as oa
from handler.pacing import BatchSizer, paced
from handler.schemas import (DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest, JobError, NativeJob,
                             parse)
from handler.settings import Settings

log = logging.getLogger("handler")


class Worker:
    def __init__(self, settings: Settings, engine: AsyncEngine | None, start_error: str | None = None,
                 timeline: Timeline | None = None):
        self.settings = settings
        self.engine = engine
        self.start_error = start_error
        self.timeline = timeline  # the cold start; "first token" is marked by the first job, which reports it
        self._cold_start_claimed = False
        self.served_name = settings.OPENAI_SERVED_MODEL_NAME_OVERRIDE or settings.MODEL_NAME or "SmolLM2-135M-Instruct"
        self.rp_config: dict | None = None  # runpod's start() config; set refresh_worker on engine faults
        self.fault: str | None = None
        self.max_in_flight = 0
        self._ids = itertools.count()
        self._running: dict[str, str] = {}  # engine request id -> job id, for jobs in flight
        self.stop_error: JobError | None = None  # set when the worker ends its jobs (shutdown)

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def end_all(self, reason: str) -> None:
        """End every job in flight, and any that starts later, with a server error (the SDK reports each one
        FAILED). Called when the shutdown grace period is over."""
        self.stop_error = JobError(reason, type="server_error", code=503)
        for rid in list(self._running):
            asyncio.ensure_future(self.engine.abort(rid, self.stop_error))

    def concurrency(self, current: int) -> int:
        return self.settings.MAX_CONCURRENCY

    def ready(self) -> None:
        """Mark ready and print the cold-start table (once the worker is about to take jobs)."""
        if self.timeline is not None:
            self.timeline.mark("ready")
            log.info("cold start:\n%s", self.timeline.table())

    async def _generate(self, prompt, params: SamplingParams, rid: str, lora, cold: list):
        """engine.generate; for the worker's first job it also marks the cold start's "first token" and puts the
        timeline into `cold` (that job returns it in its metrics)."""
        if self.stop_error is not None:
            raise self.stop_error
        claim = self.timeline is not None and not self._cold_start_claimed
        self._cold_start_claimed = True
        async for out in self.engine.generate(prompt, params, request_id=rid, lora=lora):
            if claim and any(c.delta_token_ids for c in out.outputs):
                claim = False
                self.timeline.mark("first token")
                log.info("cold start to first token: %.2f s", self.timeline.total())
                cold.append(self.timeline.as_dict())
            yield out

    async def handle(self, job: dict) -> AsyncIterator[Any]:
        """runpod calls this per job; each yield is one streamed chunk."""
        inp = job.get("input")
        job_id = job.get("id")
        rid = f"{job_id}#{next(self._ids)}"  # engine request id: unique even if a job id repeats
        self._running[rid] = job_id
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        log.info("job %s started (in flight: %d)", job_id, self.in_flight)
        outcome = "cancelled"
        try:
            if self.engine is None or self.fault:
                raise JobError(f"the worker could not serve: {self.fault or self.start_error}", type="server_error",
                               code=500)
            if self.stop_error is not None:
                raise self.stop_error
            if isinstance(inp, dict) and ("openai_route" in inp or "openai_input" in inp):
                gen = self._openai(inp, rid)
            else:
                gen = self._native(inp, rid)
            async for chunk in gen:
                yield chunk
            outcome = "done"
        except JobError as e:
            outcome = f"rejected ({e.param})"
            yield {"error": json.dumps(e.to_dict()["error"])}
        except InvalidRequestError as e:
            outcome = f"rejected ({e.field})"
            yield {"error": json.dumps(JobError(str(e), param=e.field).to_dict()["error"])}
        except asyncio.CancelledError:
            # Runpod cancelled the job or the client left: free its KV now, then let cancellation proceed.
            await asyncio.shield(self.engine.abort(rid))
            raise
        except EngineFault as e:
            outcome = "engine fault"
            self._on_fault(e)
            yield {"error": json.dumps(JobError(str(e), type="server_error", code=500).to_dict()["error"])}
        except EngineError as e:  # not the job's fault (an adapter's S3 store is down): this job only
            outcome = f"failed ({e})"
            yield {"error": json.dumps(JobError(str(e), param=getattr(e, "field", None), type="server_error",
                                                code=502).to_dict()["error"])}
        except Exception as e:  # noqa: BLE001 - a bug of ours: this job gets an error object, the worker serves on
            outcome = f"failed ({type(e).__name__})"
            log.exception("job %s failed", job_id)
            yield {"error": json.dumps(JobError(f"internal error: {type(e).__name__}: {e}", type="server_error",
                                                code=500).to_dict()["error"])}
        finally:
            self._running.pop(rid, None)
            self._log_end(job_id, outcome)

    def _log_end(self, job_id, outcome: str) -> None:
        st = self.engine.stats() if self.engine is not None else {}
        log.info("job %s %s (in flight: %d, max so far: %d); KV blocks free %s/%s, running %s, waiting %s", job_id,
                 outcome, self.in_flight, self.max_in_flight, st.get("num_free_blocks"), st.get("num_total_blocks"),
                 st.get("running"), st.get("waiting"))

    def _on_fault(self, e: Exception) -> None:
        if self.fault is None:
            log.error("engine fault: %s; asking Runpod to replace this worker", e)
        self.fault = str(e)
        if self.rp_config is not None:
            self.rp_config["refresh_worker"] = True  # the SDK stops the pod once in-flight jobs report

    # ---- native jobs ----------------------------------------------------------------------
    async def _native(self, inp: Any, rid: str) -> AsyncIterator[dict]:
        job = parse(NativeJob, inp)
        sp = job.sampling_params.model_dump()
        default_max = sp["max_tokens"] is None
        if default_max:
            sp["max_tokens"] = DEFAULT_MAX_TOKENS
        params = _sampling(sp, "sampling_params")
        lora = None
        if job.lora is not None:
            lora = LoRARequest(job.lora) if isinstance(job.lora, str) else LoRARequest(job.lora.name, job.lora.s3_uri)
            self.engine.resolve_lora(lora)  # a bad name or bucket is this job's error, before any work
        if job.use_openai_format:
            if not job.messages:
                raise JobError("use_openai_format needs messages", param="messages")
            body = {"messages": [m.model_dump(exclude_none=True) for m in job.messages], "stream": job.stream,
                    **{k: v for k, v in job.sampling_params.model_dump(exclude_unset=True).items()
                       if k != "logprobs"}}
            body.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
            async for chunk in self._openai({"openai_route": "/v1/chat/completions", "openai_input": body}, rid,
                                            lora):
                yield chunk
            return
        prompt, params = self._fit(await self._native_prompt(job), params, "sampling_params.max_tokens")
        s = self.settings
        sizer = BatchSizer(job.min_batch_size or s.DEFAULT_MIN_BATCH_SIZE,
                           job.batch_size_growth_factor or s.DEFAULT_BATCH_SIZE_GROWTH_FACTOR,
                           job.max_batch_size or s.DEFAULT_BATCH_SIZE)
        n = params.n
        pending: list[list[str]] = [[] for _ in range(n)]
        out_tokens, finish, n_input, metrics = 0, [None] * n, 0, None
        cold: list = []
        gen = self._generate(prompt, params, rid, lora, cold)
        async for group in (self._paced(gen, sizer) if job.stream else _whole(gen)):
            for out in group:
                n_input, metrics = len(out.prompt_token_ids), out.metrics
                for c in out.outputs:
                    if c.delta_text:
                        pending[c.index].append(c.delta_text)
                    out_tokens += len(c.delta_token_ids)
                    finish[c.index] = c.finish_reason
            if not group[-1].finished:
                yield _native_chunk(pending, n_input, out_tokens)
                pending = [[] for _ in range(n)]
        final = _native_chunk(pending, n_input, out_tokens, finish)
        if metrics is not None:  # worker-vllm's usage, extended
            final["usage"]["cached_input"] = metrics.cached_prompt_tokens
            final["metrics"] = {k: round(v, 6) if isinstance(v, float) else v
                                for k, v in dataclasses.asdict(metrics).items()}
            if cold:
                final["metrics"]["cold_start"] = cold[0]
        final["max_tokens"] = params.max_tokens
        if default_max:
            final["note"] = f"sampling_params.max_tokens not given; used the default {DEFAULT_MAX_TOKENS}"
        yield final

    async def _native_prompt(self, job: NativeJob) -> str:
        if job.messages:
            return await self._chat_prompt([m.model_dump(exclude_none=True) for m in job.messages], "messages")
        if job.prompt is None or job.prompt == "":
            raise JobError("give a non-empty prompt or messages", param="prompt")
        if job.apply_chat_template:
            return await self._chat_prompt([{"role": "user", "content": job.prompt}], "prompt")
        return job.prompt

    async def _chat_prompt(self, messages: list[dict], param: str, add_generation_prompt: bool = True,
                           template_kwargs: dict | None = None) -> str:
        """Rendered on a thread: a template that only transformers can render loads its tokenizer on first use,
        which must not stall the other jobs' streams. template_kwargs: the request's chat_template_kwargs."""
        kw = dict(template_kwargs or {})
        taken = sorted(kw.keys() & _RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise JobError(f"chat_template_kwargs may not set {taken}: the request sets them",
                           param=f"openai_input.chat_template_kwargs.{taken[0]}")
        try:
            return await asyncio.to_thread(
                self.engine.tok.apply_chat_template, messages, add_generation_prompt=add_generation_prompt,
                chat_template=self.settings.CUSTOM_CHAT_TEMPLATE, **kw)
        except Exception as e:  # jinja errors from a template the messages do not fit
            raise JobError(f"{param}: the chat template rejected these messages: {e}", param=param) from None

    # ---- OpenAI jobs ----------------------------------------------------------------------
    async def _openai(self, inp: dict, rid: str, lora: LoRARequest | None = None) -> AsyncIterator[Any]:
        route = inp.get("openai_route")
        body = inp.get("openai_input") or {}
        if route == "/v1/models":  # the base model, then the adapters configured or used so far
            yield oa.models_list([self.served_name] + self.engine.lora_names())
            return
        if route == "/v1/chat/completions":
            req = parse(ChatCompletionRequest, body, "openai_input")
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            prompt = await self._chat_prompt(messages, "openai_input.messages", req.add_generation_prompt,
                                             req.chat_template_kwargs)
            shapes, max_tokens = oa.ChatShapes(self.served_name), req.max_completion_tokens or req.max_tokens
            top_n = req.top_logprobs or 0 if req.logprobs else None
        elif route == "/v1/completions":
            req = parse(CompletionRequest, body, "openai_input")
            prompt = {"prompt_token_ids": req.prompt} if isinstance(req.prompt, list) else req.prompt
            shapes, max_tokens, top_n = oa.CompletionShapes(self.served_name), req.max_tokens, req.logprobs
        else:
            raise JobError(f"openai_route {route!r} is not one of /v1/chat/completions, /v1/completions, "
                           "/v1/models", param="openai_route", type="not_found_error", code=404)
        if req.model is not None and req.model != self.served_name:
            if not self.settings.ENABLE_LORA:
                raise JobError(f"model {req.model!r} is not served here; use {self.served_name!r}", param="model",
                               type="not_found_error", code=404)
            lora = LoRARequest(req.model)  # vLLM's multi-LoRA serving: the model name is the adapter's
            try:
                self.engine.resolve_lora(lora)
            except InvalidRequestError as e:
                raise JobError(f"model {req.model!r}: {e}", param="model", type="not_found_error", code=404) from None
        fields = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                  "skip_special_tokens", "include_stop_str_in_output")
        params = _sampling({**{f: getattr(req, f) for f in fields}, "logprobs": top_n,
                            "max_tokens": max_tokens or 1}, "openai_input")
        prompt, params = self._fit(prompt, params, "openai_input.max_tokens", default_room=not max_tokens,
                                   prompt_param="openai_input.messages" if route == "/v1/chat/completions" else
                                   "openai_input.prompt")
        chat = not isinstance(shapes, oa.CompletionShapes)
        cold: list = []
        gen = self._generate(prompt, params, rid, lora, cold)
        if req.stream:
            async for chunk in self._openai_stream(gen, shapes, req, chat, top_n):
                yield chunk
            return
        n_in, n_out, choices, cached = 0, 0, [], 0
        async for out in gen:
            n_in = len(out.prompt_token_ids)
            if out.finished:
                cached = out.metrics.cached_prompt_tokens
                for c in out.outputs:
                    n_out += len(c.token_ids)
                    lp = None
                    if top_n is not None and c.logprobs:
                        lp = self._logprobs(chat, c.token_ids, c.logprobs, top_n)
                    choices.append({"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                                    "logprobs": lp})
        full = shapes.full(choices, oa.usage(n_in, n_out, cached))
        if cold:
            full["metrics"] = {"cold_start": cold[0]}  # an extension field; OpenAI clients ignore it
        yield full

    def _logprobs(self, chat: bool, token_ids: list[int], lps: list[dict], top_n: int) -> dict:
        """OpenAI's logprobs object for these tokens (chat or completions shape)."""
        return (oa.chat_logprobs if chat else oa.completion_logprobs)(self.engine.tok, token_ids, lps, top_n)

    def _paced(self, gen, sizer: BatchSizer):
        return paced(gen, sizer, self.settings.STREAM_FLUSH_MS / 1000)

    async def _openai_stream(self, gen, shapes, req, chat: bool, top_n) -> AsyncIterator[str]:
        s = self.settings
        sizer = BatchSizer(s.DEFAULT_MIN_BATCH_SIZE, s.DEFAULT_BATCH_SIZE_GROWTH_FACTOR, s.DEFAULT_BATCH_SIZE)
        events, n_in, n_out, cached = [], 0, 0, 0
        if chat:
            events += [oa.sse(shapes.chunk(i, {"role": "assistant", "content": ""})) for i in range(req.n)]
        async for group in self._paced(gen, sizer):
            for out in group:
                n_in = len(out.prompt_token_ids)
                if out.finished:
                    cached = out.metrics.cached_prompt_tokens
                for c in out.outputs:
                    n_out += len(c.delta_token_ids)
                    if not (c.delta_text or c.finish_reason or c.delta_token_ids):
                        continue
                    lp = None
                    if top_n is not None and c.delta_token_ids and c.logprobs:
                        lp = self._logprobs(chat, c.delta_token_ids, c.logprobs[-len(c.delta_token_ids):], top_n)
                    if c.delta_text or lp is not None:
                        events.append(oa.sse(shapes.chunk(c.index, {"content": c.delta_text}, None, lp)))
                    if c.finish_reason:
                        events.append(oa.sse(shapes.chunk(c.index, {}, c.finish_reason)))
            if events and not group[-1].finished:
                yield "".join(events)
                events = []
        if req.stream_options and req.stream_options.include_usage:
            events.append(oa.sse(shapes.usage_chunk(oa.usage(n_in, n_out, cached))))
        events.append(oa.SSE_DONE)
        yield "".join(events)

    def _fit(self, prompt, params: SamplingParams, param: str, default_room: bool = False,
             prompt_param: str | None = None):
        """Tokenize once and check the context: a max_tokens the context cannot hold is an error (as in
        vLLM's OpenAI server); with no max_tokens on OpenAI routes, use all the room left. param: the
        max_tokens field's path; prompt_param: the field the prompt came from (default: the engine's name)."""
        try:
            ids = self.engine.tokenize(prompt)
        except InvalidRequestError as e:
            raise JobError(str(e), param=prompt_param or e.field) from None
        try:
            self.engine.check_params(params)  # n, stop_token_ids: limits of this engine
        except InvalidRequestError as e:
            raise JobError(str(e), param=f"{param.rsplit('.', 1)[0]}.{e.field}") from None
        room = self.engine.max_model_len - len(ids)
        if default_room:
            params.max_tokens = room
        elif params.max_tokens > room:
            raise JobError(f"max_tokens={params.max_tokens} does not fit: the prompt has {len(ids)} tokens and the "
                           f"context is {self.engine.max_model_len}, leaving room for {room}", param=param)
        return {"prompt_token_ids": ids}, params


# apply_chat_template's own arguments, which the request sets: a template kwarg cannot override them
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "add_generation_prompt", "chat_template",
                                       "tokenize"})


async def _whole(gen) -> AsyncIterator[list]:
    """A non-streamed job's outputs as one group (paced()'s shape)."""
    yield [out async for out in gen]


def _native_chunk(pending: list[list[str]], n_input: int, n_output: int, finish=None) -> dict:
    choices = [{"tokens": p} for p in pending]
    if finish is not None:
        for c, f in zip(choices, finish):
            c["finish_reason"] = f
    return {"choices": choices, "usage": {"input": n_input, "output": n_output}}


def _sampling(kw: dict, where: str) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        raise JobError(str(e), param=f"{where}.{e.field}" if e.field else where) from None
    except TypeError as e:
        raise JobError(str(e), param=where) from None


async def run_test_job(worker: Worker, job: Any, out) -> int:
    """runpod's --test_input contract, which the SDK breaks for generator handlers: run the job through
    our handler, print each chunk and the aggregate output; 0 on success, 1 on error."""
    chunks, t0 = [], time.perf_counter()
    if not isinstance(job, dict):
        error = JobError(f"the test job must be a JSON object with an 'input', not {type(job).__name__}")
        print(json.dumps({"status": "FAILED", "error": json.dumps(error.to_dict()["error"])}), file=out, flush=True)
        return 1
    async for chunk in worker.handle({"id": job.get("id", "local_test"), "input": job.get("input")}):
        print(f"--- chunk {len(chunks)}: {json.dumps(chunk, ensure_ascii=False)}", file=out, flush=True)
        chunks.append(chunk)
        if isinstance(chunk, dict) and chunk.get("error"):
            print(json.dumps({"status": "FAILED", "error": chunk["error"]}), file=out, flush=True)
            return 1
    print(json.dumps({"status": "COMPLETED", "output": chunks,
                      "executionTime": int(1000 * (time.perf_counter() - t0))}, ensure_ascii=False), file=out,
          flush=True)
    return 0

