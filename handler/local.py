"""Local Runpod emulator: Runpod's public endpoint API in front, the SDK's real worker loop behind.

    python -m handler.local --port 8000 [--host 127.0.0.1] [--worker-cmd "python -m handler"]

Front, endpoint id ``local``: ``runpod.Endpoint("local")`` (``runpod.endpoint_url_base = "http://H:P/v2"``)
and the ``openai`` client (``base_url="http://H:P/v2/local/openai/v1"``) work unmodified.
  POST /v2/local/run | /runsync (waits --runsync-wait s, then answers {"id", "status": "IN_PROGRESS"})
  GET  /v2/local/status/{id} | /stream/{id} (chunks since the last poll, long-polled --stream-wait s)
  POST /v2/local/cancel/{id} | /purge-queue    GET /v2/local/health
  POST .../openai/v1/chat/completions | /completions, GET .../openai/v1/models become jobs with input
  {"openai_route": "/v1/...", "openai_input": body ({} for models)}. With "stream": true the job's chunks
  (SSE text) pass through verbatim, with the job's id in an X-Job-Id header; else the single yielded object is
  the body. Error objects come back in OpenAI's shape with their "code" as HTTP status (else 400; crashes 500).
  A client that leaves cancels. /status adds "streamPosts": the worker's job-stream POSTs for the job so far.

Back: the worker subprocess runs runpod-python's JobScaler, pointed here by ``worker_env``'s
RUNPOD_WEBHOOK_* templates (the SDK fills in $ID / $RUNPOD_POD_ID and appends "&k=v"):
  GET  .../job-take/{w}?gpu=local&job_in_progress=0|1                    -> {"id", "input"} or 204
  GET  .../job-take-batch/{w}?gpu=local&batch_size=N&job_in_progress=0|1 -> [{"id", "input"}] or 204
  POST .../job-stream/{w}/{id}?gpu=local&isStream=false      {"output": chunk}, one POST per yield
  POST .../job-done/{w}/{id}?gpu=local&isStream=true|false   {"output": ...} and/or {"error": ...}
  GET  .../job-stop/{w}?gpu=local                            -> {"jobsToStop": [ids]} or 204
  GET  .../ping/{w}?job_id=a,b&runpod_version=V              heartbeat, from a separate process
Job-take and job-stop are long-polls (the SDK re-polls a 204 at once). Result bodies are JSON sent as
x-www-form-urlencoded. Cancel: the SDK (>= 1.10) cancels the job's asyncio task when job-stop names it,
so CancelledError is raised in the handler and no job-done follows; here the job turns CANCELLED at once
and later output for it is ignored. Not emulated: TIMED_OUT, webhooks, retries, several workers.
Worker output goes to our stderr. If it exits, its running jobs fail (queued ones too unless
--restart-worker). "ready" is logged at its first job-take, request counts every 30 s and at exit.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from handler.local_jobs import EP, Job, Pulse, error_response, json_body, openai_result, pdeathsig, sse, worker_env

log = logging.getLogger("handler.local")


def _ok() -> Response:
    return Response(b"{}", media_type="application/json")


class Emulator:
    def __init__(self, worker_cmd: list[str], base_url: str, *, runsync_wait: float = 90.0,
                 stream_wait: float = 1.0, poll_hold: float = 10.0,
                 restart: bool = False, grace: float = 5.0, retention: float = 900.0) -> None:
        self.worker_cmd, self.base, self.restart, self.grace = worker_cmd, base_url, restart, grace
        self.runsync_wait, self.stream_wait, self.poll_hold = runsync_wait, stream_wait, poll_hold
        self.retention = retention
        self.jobs: dict[str, Job] = {}
        self.queue: collections.deque[str] = collections.deque()
        self.stops: list[str] = []
        self.queue_pulse, self.stop_pulse = Pulse(), Pulse()
        self.counts: collections.Counter = collections.Counter()  # requests by kind
        self.totals: collections.Counter = collections.Counter()  # jobs by final status
        self.proc: asyncio.subprocess.Process | None = None
        self.state = "initializing"  # -> ready -> exited
        self.spawned = self.last_ping = None
        self.shutting_down = False
        self.tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ jobs
    def submit(self, job_input: Any, prefix: str = "") -> Job:
        now = time.monotonic()
        for old in [j.id for j in self.jobs.values() if j.done and now - j.finished > self.retention]:
            del self.jobs[old]
        job = self.jobs.setdefault(jid := prefix + str(uuid.uuid4()), Job(jid, job_input))
        if self.shutting_down or (self.state == "exited" and not self.restart):
            self.finish(job, "FAILED", error=f"local worker is not running ({self.state})")
        else:
            self.queue.append(job.id)
            self.queue_pulse.fire()
        return job

    def finish(self, job: Job, status: str, output: Any = None, error: Any = None) -> None:
        if not job.done:
            job.status, job.output, job.error, job.finished = status, output, error, time.monotonic()
            self.totals[status] += 1
            job.changed.fire()

    def cancel(self, job: Job) -> None:
        was = job.status
        if was == "IN_QUEUE":
            self.queue.remove(job.id)
        self.finish(job, "CANCELLED")
        if was == "IN_PROGRESS" and job.id not in self.stops:
            self.stops.append(job.id)
            self.stop_pulse.fire()

    async def wait_done(self, job: Job, timeout: float | None, request: Request | None = None) -> None:
        """Wait for a terminal state (or ``timeout``); with ``request``, cancel if its client goes away."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e12)
        while not job.done and (left := deadline - time.monotonic()) > 0:
            if not await job.changed.wait(min(1.0, left)) and request and await request.is_disconnected():
                log.info("client went away: cancelling %s", job.id)
                self.cancel(job)

    # ---------------------------------------------------------------- worker
    async def start(self) -> None:
        self.tasks = [asyncio.create_task(self._log_counts()), asyncio.create_task(self._run_worker())]

    async def _run_worker(self) -> None:
        host, port = self.base.split("/")[2].rsplit(":", 1)
        while True:  # spawn once we accept connections: the SDK retries a refused job-take in a tight loop
            with contextlib.suppress(OSError):
                (await asyncio.open_connection(host, int(port)))[1].close()
                break
            await asyncio.sleep(0.05)
        while not self.shutting_down:
            self.state, self.spawned = "initializing", time.monotonic()
            self.proc = await asyncio.create_subprocess_exec(
                *self.worker_cmd, env=worker_env(self.base), stdin=asyncio.subprocess.DEVNULL,
                stdout=sys.stderr.fileno(), stderr=sys.stderr.fileno(), start_new_session=True,
                preexec_fn=pdeathsig())
            log.info("worker started (pid %d): %s", self.proc.pid, shlex.join(self.worker_cmd))
            code = await self.proc.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, 0)  # raises when the worker's process group is gone, as it should be
                log.warning("the worker left processes behind: killing them")
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.state = "exited"
            (log.info if self.shutting_down else log.error)("worker exited with code %s", code)
            restart = self.restart and not self.shutting_down
            for job in list(self.jobs.values()):
                if job.status == "IN_PROGRESS" or (job.status == "IN_QUEUE" and not restart):
                    if job.status == "IN_QUEUE":
                        self.queue.remove(job.id)
                    self.finish(job, "FAILED", error=f"local worker exited with code {code}")
            if not restart:
                return
            await asyncio.sleep(1.0)

    def begin_shutdown(self) -> None:
        """Stop the running jobs (so the SDK's graceful drain is quick), fail what is left, release the
        long-polls and SIGTERM the worker. Idempotent."""
        if not self.shutting_down:
            self.shutting_down = True
            self.stops += [j.id for j in self.jobs.values() if j.status == "IN_PROGRESS"]
            for job in list(self.jobs.values()):
                self.finish(job, "FAILED", error="local emulator is shutting down")
            self.queue.clear()
            self.queue_pulse.fire()
            self.stop_pulse.fire()
            if self.proc and self.proc.returncode is None:
                self.proc.send_signal(signal.SIGTERM)

    async def stop(self) -> None:
        self.begin_shutdown()
        if self.proc and self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), self.grace)
            except asyncio.TimeoutError:
                log.warning("worker ignored SIGTERM for %.0f s: SIGKILL", self.grace)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        log.info("stopped. %s", self._summary())

    def _summary(self) -> str:
        reqs = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        jobs = " ".join(f"{k.lower()}={v}" for k, v in sorted(self.totals.items()))
        return f"requests: {reqs or '-'} | jobs: {jobs or '-'}"

    async def _log_counts(self) -> None:
        last = None
        while True:
            await asyncio.sleep(30)
            if (line := self._summary()) != last:
                log.info("%s", last := line)

    # ----------------------------------------------------- worker-facing API
    async def job_take(self, request: Request) -> Response:
        self.counts["job-take"] += 1
        if self.state == "initializing":
            self.state = "ready"
            log.info("ready: the worker made its first job-take %.1f s after spawn; serving %s",
                     time.monotonic() - self.spawned, self.base)
        deadline = time.monotonic() + self.poll_hold
        while not self.queue and not self.shutting_down and time.monotonic() < deadline:
            await self.queue_pulse.wait(deadline - time.monotonic())
        if not self.queue or self.shutting_down or await request.is_disconnected():
            return Response(status_code=204)
        batch = "/job-take-batch/" in request.url.path
        n = max(1, int(request.query_params.get("batch_size", 1))) if batch else 1
        jobs = [self.jobs[self.queue.popleft()] for _ in range(min(n, len(self.queue)))]
        payload = [{"id": job.id, "input": job.input} for job in jobs]
        try:  # serialize before marking them taken: a job that cannot be sent must not sit IN_PROGRESS forever
            response = JSONResponse(payload if batch else payload[0])
        except ValueError as e:
            for job in jobs:
                self.finish(job, "FAILED", error=f"the emulator could not send this job to the worker: {e}")
            return Response(status_code=204)
        for job in jobs:
            job.status, job.started = "IN_PROGRESS", time.monotonic()
            job.changed.fire()
        return response

    async def job_stop(self, request: Request) -> Response:
        self.counts["job-stop"] += 1
        deadline = time.monotonic() + self.poll_hold
        while not self.stops and not self.shutting_down and time.monotonic() < deadline:
            await self.stop_pulse.wait(deadline - time.monotonic())
        if not self.stops or await request.is_disconnected():
            return Response(status_code=204)
        ids, self.stops = self.stops, []
        log.info("job-stop -> worker: %s", ", ".join(ids))
        return JSONResponse({"jobsToStop": ids})

    async def job_result(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        final = "/job-done/" in request.url.path
        self.counts["job-done" if final else "job-stream"] += 1
        raw = await request.body()
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            log.error("unparseable result for %s: %.200r", job_id, raw)
            payload = {"error": "the emulator could not parse the worker's result"}
        job = self.jobs.get(job_id)
        if job and job.status == "CANCELLED" and not final and job.id not in self.stops:
            self.stops.append(job.id)  # it was taken but not started when cancelled: stop it again
            self.stop_pulse.fire()
        if job is None or job.done:  # unknown, or cancelled: ignored
            return _ok()
        if final:
            if payload.get("error") is not None:
                self.finish(job, "FAILED", payload.get("output"), payload["error"])
            else:
                self.finish(job, "COMPLETED", payload.get("output"))
        elif "output" in payload:
            job.chunks.append(payload["output"])
            job.changed.fire()
        return _ok()

    async def ping(self, request: Request) -> Response:
        self.counts["ping"] += 1
        self.last_ping = time.monotonic()
        if request.query_params.get("status") == "unhealthy":
            log.error("worker unhealthy: %s: %s", request.query_params.get("check"),
                      request.query_params.get("reason"))
        return _ok()

    # ------------------------------------------------------------ public API
    async def _new_job(self, request: Request, prefix: str) -> Job | Response:
        self.counts[prefix.rstrip("-") or "run"] += 1
        try:
            body = json_body(await request.body())
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
        new, job.stream_pos = job.chunks[job.stream_pos:], len(job.chunks)
        out = {"id": job.id, "status": job.status, "stream": [{"output": c} for c in new]}
        return out | ({"error": job.error} if job.error is not None else {})

    async def cancel_route(self, job_id: str):
        job = self._lookup(job_id, "cancel")
        if isinstance(job, Response):
            return job
        self.cancel(job)
        return {"id": job.id, "status": job.status}

    async def purge_queue(self):
        self.counts["purge-queue"] += 1
        queued = [self.jobs[jid] for jid in self.queue]
        for job in queued:
            self.cancel(job)
        return {"removed": len(queued), "status": "completed"}

    async def health(self):
        self.counts["health"] += 1
        running = sum(j.status == "IN_PROGRESS" for j in self.jobs.values())
        ready = self.state == "ready"
        return {
            "jobs": {"completed": self.totals["COMPLETED"], "failed": self.totals["FAILED"],
                     "cancelled": self.totals["CANCELLED"], "inProgress": running, "inQueue": len(self.queue),
                     "retried": 0},
            "workers": {"idle": int(ready and not running), "running": int(ready and running > 0),
                        "ready": int(ready), "initializing": int(self.state == "initializing"),
                        "throttled": 0, "unhealthy": int(self.state == "exited")},
            "localWorker": {"state": self.state, "pid": self.proc and self.proc.pid,
                            "returncode": self.proc and self.proc.returncode, "requests": dict(self.counts),
                            "lastPingAgoS": self.last_ping and round(time.monotonic() - self.last_ping, 1)}}

    async def openai(self, request: Request) -> Response:
        self.counts["openai"] += 1
        route = request.url.path.split("/openai", 1)[1]
        body: Any = {}
        if request.method == "POST":
            try:
                body = json_body(await request.body())
            except ValueError as e:
                return error_response({"message": f"the body is not valid JSON: {e}", "type": "BadRequestError"})
        job = self.submit({"openai_route": route, "openai_input": body})
        if not (isinstance(body, dict) and body.get("stream")):
            await self.wait_done(job, None, request)
            return openai_result(job)
        while not job.chunks and not job.done:  # hold the headers until we know it is not an error
            if not await job.changed.wait(1.0) and await request.is_disconnected():
                self.cancel(job)
        if not job.chunks:
            return openai_result(job)
        return StreamingResponse(self._sse_stream(job), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Job-Id": job.id})

    async def _sse_stream(self, job: Job):
        pos = 0
        try:
            while True:
                while pos < len(job.chunks):
                    pos += 1
                    yield sse(job.chunks[pos - 1])
                if job.done:
                    break
                await job.changed.wait(5.0)
            if job.status == "FAILED":  # failed mid-stream: an error event, then [DONE], as vLLM does
                yield f"data: {error_response(job.error).body.decode()}\n\ndata: [DONE]\n\n"
        finally:
            if not job.done:
                log.info("stream client went away: cancelling %s", job.id)
                self.cancel(job)



def create_app(worker_cmd: list[str] | str, *, host: str = "127.0.0.1", port: int = 8000,
               **options: Any) -> FastAPI:
    """The emulator app; the worker subprocess lives with its lifespan. ``options`` go to ``Emulator``:
    runsync_wait, stream_wait, poll_hold, restart, grace (SIGTERM -> SIGKILL), retention (of results)."""
    if isinstance(worker_cmd, str):
        worker_cmd = shlex.split(worker_cmd)
    connect = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    emu = Emulator(worker_cmd, f"http://{connect}:{port}/v2/{EP}", **options)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        await emu.start()
        try:
            yield
        finally:
            await emu.stop()

    app = FastAPI(title="Local Runpod emulator", lifespan=lifespan)
    app.state.emulator = emu
    routes = [("POST", "/run", emu.run), ("POST", "/runsync", emu.runsync),
              ("GET", "/status/{job_id}", emu.status), ("GET", "/stream/{job_id}", emu.stream),
              ("POST", "/cancel/{job_id}", emu.cancel_route), ("POST", "/purge-queue", emu.purge_queue),
              ("GET", "/health", emu.health), ("POST", "/openai/v1/chat/completions", emu.openai),
              ("POST", "/openai/v1/completions", emu.openai), ("GET", "/openai/v1/models", emu.openai)]
    for method, path, endpoint in routes:
        app.add_api_route(f"/v2/{EP}{path}", endpoint, methods=[method])
    # The worker-facing routes are plain Starlette routes (request in, Response out): a streaming worker POSTs
    # once per yield, so FastAPI's per-request validation and serialization would be paid hundreds of times a
    # second, on the cores the worker computes on.
    for method, path, endpoint in [
            ("GET", "/job-take/{worker_id}", emu.job_take), ("GET", "/job-take-batch/{worker_id}", emu.job_take),
            ("GET", "/job-stop/{worker_id}", emu.job_stop), ("GET", "/ping/{worker_id}", emu.ping),
            ("POST", "/job-stream/{worker_id}/{job_id}", emu.job_result),
            ("POST", "/job-done/{worker_id}/{job_id}", emu.job_result)]:
        app.router.add_route(f"/v2/{EP}{path}", endpoint, methods=[method])
    return app


class _Server(uvicorn.Server):
    """Begins the emulator's shutdown on the signal, so held long-polls don't delay uvicorn's exit."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_soon_threadsafe(self.config.app.state.emulator.begin_shutdown)
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m handler.local", description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--worker-cmd", default=f"{shlex.quote(sys.executable)} -m handler",
                    help="the worker command line (default: %(default)s)")
    ap.add_argument("--restart-worker", action="store_true", help="restart the worker when it exits")
    ap.add_argument("--runsync-wait", type=float, default=90.0, help="seconds /runsync waits (90)")
    ap.add_argument("--stream-wait", type=float, default=1.0, help="seconds /stream long-polls (1)")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="%(asctime)s local-rp | %(message)s", datefmt="%H:%M:%S")
    app = create_app(args.worker_cmd, host=args.host, port=args.port,
                     runsync_wait=args.runsync_wait, stream_wait=args.stream_wait, restart=args.restart_worker)
    _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                           timeout_graceful_shutdown=3)).run()


if __name__ == "__main__":
    main()
