"""The async generator handler: one job in, chunks out. This module routes each job (native_jobs.py,
openai_jobs.py), runs its life cycle, and turns every failure into the job's one error object.

Errors in a job end that job with one error object and never touch other jobs. An engine fault (the step
loop raised) ends every in-flight job with an error and asks Runpod to replace this worker."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from engine import AsyncEngine, EngineError, EngineFault, InvalidRequestError, SamplingParams, Timeline
from handler.native_jobs import native_job
from handler.openai_jobs import openai_job
from handler.pacing import BatchSizer, paced
from handler.schemas import JobError
from handler.settings import Settings

log = logging.getLogger("handler")


class Worker:
    def __init__(
        self,
        settings: Settings,
        engine: AsyncEngine | None,
        start_error: str | None = None,
        timeline: Timeline | None = None,
    ):
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
        self.stop_error = JobError(reason, type="server_error", status=503)  # unavailable: send it again
        for rid in list(self._running):
            asyncio.ensure_future(self.engine.abort(rid, self.stop_error))

    def concurrency(self, current: int) -> int:
        return self.settings.MAX_CONCURRENCY

    def ready(self) -> None:
        """Mark ready and print the cold-start table (once the worker is about to take jobs)."""
        if self.timeline is not None:
            self.timeline.mark("ready")
            log.info("cold start:\n%s", self.timeline.table())

    async def generate(self, prompt, params: SamplingParams, rid: str, lora, cold: list):
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
        outcome, openai = "cancelled", False
        try:
            if self.engine is None or self.fault:
                raise JobError(f"the worker could not serve: {self.fault or self.start_error}", type="server_error")
            if self.stop_error is not None:
                raise self.stop_error
            if openai := isinstance(inp, dict) and ("openai_route" in inp or "openai_input" in inp):
                gen = openai_job(self, inp, rid)
            else:
                gen = native_job(self, inp, rid)
            async for chunk in gen:
                yield chunk
            outcome = "done"
        except asyncio.CancelledError:
            # Runpod cancelled the job or the client left: free its KV now, then let cancellation proceed.
            await asyncio.shield(self.engine.abort(rid))
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes this job's error object; the worker serves on
            error, outcome = self._job_error(e, job_id)
            if openai:  # its request was validated as the job's "openai_input": name the fields as its client does
                error = error.rebased("openai_input")
            yield {"error": json.dumps(error.to_dict()["error"])}
        finally:
            self._running.pop(rid, None)
            self._log_end(job_id, outcome)

    def _job_error(self, e: Exception, job_id) -> tuple[JobError, str]:
        """The error object a failed job returns, and how the log describes the ending. Called in `except`."""
        if isinstance(e, JobError):  # the request's fault, or the worker's state (shutting down, no engine)
            return e, f"rejected ({e.param})"
        if isinstance(e, InvalidRequestError):
            return JobError(str(e), param=e.field), f"rejected ({e.field})"
        if isinstance(e, EngineFault):  # the step loop raised: every job fails, Runpod replaces this worker
            self._on_fault(e)
            return JobError(str(e), type="server_error"), "engine fault"
        if isinstance(e, EngineError):  # not the job's fault (an adapter's S3 store is down): this job only
            error = JobError(str(e), param=getattr(e, "field", None), type="server_error", status=502)
            return error, f"failed ({e})"
        log.exception("job %s failed", job_id)  # a bug of ours
        return JobError(f"internal error: {type(e).__name__}: {e}", type="server_error"), f"failed ({type(e).__name__})"

    def _log_end(self, job_id, outcome: str) -> None:
        st = self.engine.stats() if self.engine is not None else {}
        log.info(
            "job %s %s (in flight: %d, max so far: %d); KV blocks free %s/%s, running %s, waiting %s",
            job_id,
            outcome,
            self.in_flight,
            self.max_in_flight,
            st.get("num_free_blocks"),
            st.get("num_total_blocks"),
            st.get("running"),
            st.get("waiting"),
        )

    def _on_fault(self, e: Exception) -> None:
        if self.fault is None:
            log.error("engine fault: %s; asking Runpod to replace this worker", e)
        self.fault = str(e)
        if self.rp_config is not None:
            self.rp_config["refresh_worker"] = True  # the SDK stops the pod once in-flight jobs report

    async def chat_prompt(
        self,
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
                self.engine.tok.apply_chat_template,
                messages,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template or self.settings.CUSTOM_CHAT_TEMPLATE,
                tools=tools,
                **kw,
            )
        except Exception as e:  # jinja errors from a template the messages do not fit
            raise JobError(f"{param}: the chat template rejected these messages: {e}", param=param) from None

    def paced(self, gen, sizer: BatchSizer):
        return paced(gen, sizer, self.settings.STREAM_FLUSH_MS / 1000)

    def fit(
        self, prompt, params: SamplingParams, param: str, default_room: bool = False, prompt_param: str | None = None
    ):
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
            raise JobError(
                f"max_tokens={params.max_tokens} does not fit: the prompt has {len(ids)} tokens and the "
                f"context is {self.engine.max_model_len}, leaving room for {room}",
                param=param,
                code="context_length_exceeded",  # OpenAI's code for it
            )
        return {"prompt_token_ids": ids}, params


# apply_chat_template's own arguments, which the request sets: a template kwarg cannot override them
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "add_generation_prompt", "chat_template", "tokenize", "tools"}
)


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
    print(
        json.dumps(
            {"status": "COMPLETED", "output": chunks, "executionTime": int(1000 * (time.perf_counter() - t0))},
            ensure_ascii=False,
        ),
        file=out,
        flush=True,
    )
    return 0
