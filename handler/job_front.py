"""The front of a Runpod endpoint: job records and the public routes over them, shared by the local emulator
(handler/local.py, whose worker is a subprocess taking jobs over Runpod's protocol) and the load-balancing server
(handler/lb.py, which runs each job in its own process).

  POST /run | /runsync (waits `runsync_wait` s, then answers {"id", "status": "IN_PROGRESS"})
  GET  /status/{id} | /stream/{id} (chunks since the last poll, long-polled `stream_wait` s)   POST /cancel/{id}
  POST /openai/v1/chat/completions | /completions, GET /openai/v1/models (openai_compat.ROUTES) become jobs with
  input {"openai_route": "/v1/...", "openai_input": body ({} for models)}. With "stream": true the job's chunks
  (SSE text) pass through verbatim, with the job's id in an X-Job-Id header; else the single yielded object is the
  body. Errors are OpenAI's {"error": {"message", "type", "param", "code"}}, with the job error's "status" as HTTP
  status (crashes 500); mid-stream, one such event and [DONE]. A client that leaves cancels its job.

A subclass decides where a job runs: `dispatch(job)` starts it, `withdraw(job, was)` stops one cancelled in state
`was`, `refusal()` says why no job can start now (None: they can)."""

from __future__ import annotations

import collections
import json
import logging
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from handler import anthropic_messages as anthropic
from handler import openai_compat as oa
from handler.local_jobs import WORKER_ID, Job, error_response, json_body, openai_result, sse_events

log = logging.getLogger("handler.local")
KEPT_RESULTS = 4096  # finished jobs' records kept for /status and /stream (besides `retention`): the oldest go first


class JobFront:
    def __init__(
        self,
        *,
        runsync_wait: float = 90.0,
        stream_wait: float = 1.0,
        retention: float = 900.0,
        worker_id: str = WORKER_ID,
    ) -> None:
        self.runsync_wait, self.stream_wait, self.retention, self.worker_id = (
            runsync_wait,
            stream_wait,
            retention,
            worker_id,
        )
        self.jobs: dict[str, Job] = {}
        self.counts: collections.Counter = collections.Counter()  # requests by kind
        self.totals: collections.Counter = collections.Counter()  # jobs by final status

    def dispatch(self, job: Job) -> None:
        raise NotImplementedError

    def withdraw(self, job: Job, was: str) -> None:
        raise NotImplementedError

    def refusal(self) -> str | None:
        return None

    async def body(self, request: Request) -> bytes:
        """A request's body (the load-balancing server caps its size)."""
        return await request.body()

    def submit(self, job_input: Any, prefix: str = "") -> Job:
        now = time.monotonic()
        done = [j for j in self.jobs.values() if j.done]  # in submission order
        for j in done[: max(0, len(done) - KEPT_RESULTS)] + [j for j in done if now - j.finished > self.retention]:
            self.jobs.pop(j.id, None)
        job = self.jobs.setdefault(jid := prefix + str(uuid.uuid4()), Job(jid, job_input, worker_id=self.worker_id))
        if (refused := self.refusal()) is not None:
            self.finish(job, "FAILED", error=refused)
        else:
            self.dispatch(job)
        return job

    def finish(self, job: Job, status: str, output: Any = None, error: Any = None) -> None:
        if not job.done:
            job.status, job.output, job.error, job.finished = status, output, error, time.monotonic()
            self.totals[status] += 1
            job.changed.fire()

    def cancel(self, job: Job) -> None:
        was = job.status
        self.finish(job, "CANCELLED")
        self.withdraw(job, was)

    async def wait_done(self, job: Job, timeout: float | None, request: Request | None = None) -> None:
        """Wait for a terminal state (or ``timeout``); with ``request``, cancel if its client goes away."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e12)
        while not job.done and (left := deadline - time.monotonic()) > 0:
            if not await job.changed.wait(min(1.0, left)) and request and await request.is_disconnected():
                log.info("client went away: cancelling %s", job.id)
                self.cancel(job)

    # ------------------------------------------------------------ routes
    async def _new_job(self, request: Request, prefix: str) -> Job | Response:
        self.counts[prefix.rstrip("-") or "run"] += 1
        try:
            body = json_body(await self.body(request))
        except ValueError as e:
            return JSONResponse({"error": f"the request body is not valid JSON: {e}"}, 400)
        if isinstance(body, dict) and "input" in body:
            return self.submit(body["input"], prefix)
        return JSONResponse({"error": "the request body must be JSON with an 'input' key"}, 400)

    def _lookup(self, job_id: str, kind: str) -> Job | Response:
        self.counts[kind] += 1
        return self.jobs.get(job_id) or JSONResponse({"error": f"job {job_id} not found"}, 404)

    async def run(self, request: Request):
        job = await self._new_job(request, "")
        return job if isinstance(job, Response) else {"id": job.id, "status": job.status}

    async def runsync(self, request: Request):
        job = await self._new_job(request, "sync-")
        if isinstance(job, Response):
            return job
        await self.wait_done(job, self.runsync_wait)
        return job.public() if job.done else {"id": job.id, "status": job.status}

    async def status(self, job_id: str):
        job = self._lookup(job_id, "status")
        return job if isinstance(job, Response) else job.public()

    async def stream(self, job_id: str):
        job = self._lookup(job_id, "stream")
        if isinstance(job, Response):
            return job
        deadline = time.monotonic() + self.stream_wait
        while job.stream_pos >= len(job.chunks) and not job.done and time.monotonic() < deadline:
            await job.changed.wait(deadline - time.monotonic())
        new, job.stream_pos = job.chunks[job.stream_pos :], len(job.chunks)
        out = {"id": job.id, "status": job.status, "stream": [{"output": c} for c in new]}
        return out | ({"error": job.error} if job.error is not None else {})

    async def cancel_route(self, job_id: str):
        job = self._lookup(job_id, "cancel")
        if isinstance(job, Response):
            return job
        self.cancel(job)
        return {"id": job.id, "status": job.status}

    async def openai(self, request: Request) -> Response:
        self.counts["openai"] += 1
        route = request.url.path.split("/openai", 1)[-1]  # the emulator's .../openai/v1/...; the server's /v1/...
        if wrong := oa.route_error(route, request.method):
            fields, status = wrong
            allow = {"Allow": oa.ROUTES[route]} if status == 405 else None
            return JSONResponse(oa.error(**fields), status, headers=allow)
        body: Any = {}
        if request.method == "POST":
            try:
                body = json_body(await self.body(request))
            except ValueError as e:
                return error_response({"message": f"the request body is not valid JSON: {e}"})
        job = self.submit({"openai_route": route, "openai_input": body})
        shaped = _anthropic_errors if route.startswith(anthropic.MESSAGES) else (lambda r: r)
        if not (isinstance(body, dict) and body.get("stream")):
            await self.wait_done(job, None, request)
            return shaped(openai_result(job))
        while not job.chunks and not job.done:  # hold the headers until we know it is not an error
            if not await job.changed.wait(1.0) and await request.is_disconnected():
                self.cancel(job)
        if not job.chunks:
            return shaped(openai_result(job))
        failed = None
        if route.startswith(anthropic.MESSAGES):  # Anthropic's stream ends in an error event

            def failed(r):
                return f"event: error\ndata: {shaped(r).body.decode()}\n\n"

        return StreamingResponse(
            sse_events(job, self.cancel, failed),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Job-Id": job.id},
        )


def _anthropic_errors(response: Response) -> Response:
    """An OpenAI-shaped error response as Anthropic's ({"type": "error", "error": {"type", "message"}})."""
    if response.status_code < 400:
        return response
    fields = json.loads(response.body)["error"]
    return JSONResponse(anthropic.error_body(fields, response.status_code), response.status_code)
