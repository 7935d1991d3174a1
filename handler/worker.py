"""The async generator handler: one job in, chunks out. This module routes each job (native_jobs.py,
openai_jobs.py) with its JobContext (jobs.py), runs its life cycle, and turns every failure into the job's one error
object.

Errors in a job end that job with one error object and never touch other jobs. An engine fault (the step
loop raised) ends every in-flight job with an error and asks Runpod to replace this worker."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from engine import AsyncEngine, EngineError, EngineFault, InvalidRequestError, Timeline
from handler import native_jobs
from handler.jobs import ColdStart, JobContext, marked
from handler.native_jobs import native_job
from handler.schemas import JobError
from handler.settings import Settings

log = logging.getLogger("handler")


def _openai_routes():
    """handler/openai_jobs.py and every OpenAI and Anthropic route it brings (their pydantic models: ~85 ms): imported
    by the first job that needs them, or after ready as an idle piece, whichever comes first."""
    from handler import openai_jobs

    return openai_jobs


def _harmony(ctx):
    from handler import harmony

    return harmony.for_model(ctx)


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
        self.timeline = timeline  # the cold start; "first token" is marked by a job, which reports it
        self.served_name = settings.OPENAI_SERVED_MODEL_NAME_OVERRIDE or settings.MODEL_NAME or "SmolLM2-135M-Instruct"
        self.ctx = JobContext(engine, settings, self.served_name)
        self.rp_config: dict | None = None  # runpod's start() config (runpod_config()); refresh_worker on faults
        self.fault: str | None = None  # the engine faulted (a step raised or hung): nothing is served after
        # how this worker stops taking work once the engine faulted, called once from any thread (the queue: the
        # SDK's drain, handler/runpod_sdk.py; the load-balancing server: its own); the process then exits
        self.on_fatal: Callable[[], None] | None = None
        if engine is not None:
            engine.on_fault = self._on_fault
            # after ready: a native first job does not wait for these imports, nor GPT-OSS's first chat for its
            # harmony encoding (~0.6 s; None for any other model)
            engine.warm_later(_openai_routes, lambda: _harmony(self.ctx))
        self.max_in_flight = 0
        self._ids = itertools.count()
        self._running: dict[str, str] = {}  # engine request id -> job id, for jobs in flight

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def runpod_config(self) -> dict:
        """runpod.serverless.start's config; the worker keeps it to ask for its replacement on an engine fault."""
        self.rp_config = {
            "handler": self.handle,
            "return_aggregate_stream": True,
            "concurrency_modifier": self.concurrency,
        }
        return self.rp_config

    def end_all(self, reason: str) -> None:
        """End every job in flight, and any that starts later, with a server error (the SDK reports each one
        FAILED). Called when the shutdown grace period is over."""
        error = JobError(reason, type="server_error", status=503)  # unavailable: send it again
        self.ctx.gate.close(error)
        for rid in list(self._running):
            asyncio.ensure_future(self.engine.abort(rid, error))

    def concurrency(self, current: int) -> int:
        return self.settings.MAX_CONCURRENCY

    def use_metrics(self, metrics) -> None:
        """Every job's engine outputs go through `metrics` (handler/metrics.py) from now on."""
        self.ctx = replace(self.ctx, metrics=metrics)

    def ready(self) -> None:
        """Mark ready and print the cold-start table (once the worker is about to take jobs)."""
        if self.timeline is not None:
            self.timeline.mark("ready")
            log.info("cold start:\n%s", self.timeline.table())
        if self.engine is not None:
            self.engine.release_idle()  # the idle pieces waited for the rest of the start

    async def handle(self, job: dict) -> AsyncIterator[Any]:
        """runpod calls this per job; each yield is one streamed chunk."""
        inp = job.get("input")
        job_id = job.get("id")
        rid = f"{job_id}#{next(self._ids)}"  # engine request id: unique even if a job id repeats
        self._running[rid] = job_id
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        log.info("job %s started (in flight: %d)", job_id, self.in_flight)
        outcome, rebase = "cancelled", _as_is
        try:
            if self.engine is None or self.fault:
                raise JobError(f"the worker could not serve: {self.fault or self.start_error}", type="server_error")
            self.ctx.gate.check()
            gen, rebase = self._route(inp, rid)
            async for chunk in gen:
                yield chunk
            outcome = "done"
        except (asyncio.CancelledError, GeneratorExit):
            # Runpod cancelled the job or the client left: free its KV now, then let cancellation proceed.
            # CancelledError: the job's task was cancelled at one of our awaits. GeneratorExit: it was cancelled while
            # the SDK sent a chunk (runpod's own generator around this one never closes it), and this generator is
            # closed later at its yield, with its inner generators still open: so every request of the job is
            # aborted by id here, a batch's other prompts too, and not left to their generators' finalizers.
            await asyncio.shield(self.engine.abort(rid, with_parts=True))
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes this job's error object; the worker serves on
            error, outcome = self._job_error(e, job_id)
            yield {"error": json.dumps(rebase(error).to_dict()["error"])}
        finally:
            self._running.pop(rid, None)
            self._log_end(job_id, outcome)
            if self.engine is not None and self.engine.unhealthy:  # repeated out-of-memory steps
                self._ask_replacement()

    def _route(self, inp: Any, rid: str) -> tuple[AsyncIterator[Any], Callable[[JobError], JobError]]:
        """The job's chunks, and how its errors name fields: an OpenAI job's as paths in its body (its client's
        own), a use_openai_format job's as paths in its native input."""
        ctx = self._context()
        if isinstance(inp, dict) and ("openai_route" in inp or "openai_input" in inp):
            oa = _openai_routes()
            return oa.openai_job(ctx, inp, rid), lambda e: e.rebased(oa.WHERE)
        job = native_jobs.parse_job(inp)
        if job.use_openai_format:
            oa, (inp, lora, sizer) = _openai_routes(), native_jobs.as_openai(ctx, job)
            return oa.openai_job(ctx, inp, rid, lora, sizer), lambda e: e.rebased(oa.WHERE, native_jobs.native_path)
        return native_job(ctx, job, rid), _as_is

    def _context(self) -> JobContext:
        """Until some job has made the worker's first token, each job is lent the cold-start timeline."""
        if self.timeline is None or marked(self.timeline):
            return self.ctx
        return replace(self.ctx, cold_start=ColdStart(self.timeline))

    def _job_error(self, e: Exception, job_id) -> tuple[JobError, str]:
        """The error object a failed job returns, and how the log describes the ending. Called in `except`."""
        if isinstance(e, JobError):  # the request's fault, or the worker's state (shutting down, no engine)
            return e, f"rejected ({e.param})"
        if isinstance(e, InvalidRequestError):
            return JobError(str(e), param=e.field), f"rejected ({e.field})"
        if isinstance(e, EngineFault):  # the step loop raised: every job fails, Runpod replaces this worker
            self._on_fault(e)
            return JobError(str(e), type="server_error"), "engine fault"
        if isinstance(e, EngineError):  # not the job's input (S3 is down, a step's NaN or OOM): this job only
            status = getattr(e, "status", 502)  # a RequestFault's own: 503 did not fit in memory, 500 NaN logits
            error = JobError(str(e), param=getattr(e, "field", None), type="server_error", status=status)
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

    @property
    def unhealthy(self) -> str | None:
        """Why Runpod should replace this worker (None: healthy): the engine faulted, or its steps keep running out
        of memory (it still serves meanwhile)."""
        if self.fault is not None or self.engine is None:
            return self.fault
        return self.engine.unhealthy

    def _on_fault(self, e: Exception) -> None:
        """The engine faulted (any thread): every job fails, Runpod replaces this worker."""
        first = self.fault is None
        self.fault = str(e)
        if first:
            log.error("engine fault: %s; asking Runpod to replace this worker", e)
        self._ask_replacement()
        if first and self.on_fatal is not None:
            self.on_fatal()

    def _ask_replacement(self) -> None:
        if self.rp_config is not None and not self.rp_config.get("refresh_worker"):
            self.rp_config["refresh_worker"] = True  # the SDK stops the worker once in-flight jobs report
            log.error("the worker is unhealthy (%s): it stops after the jobs in flight", self.unhealthy)


def _as_is(error: JobError) -> JobError:
    return error


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
