"""Load-balancing endpoint mode: the worker is the HTTP server Runpod routes each request to (no queue in front).

    RUNPOD_ENDPOINT_TYPE=lb python -m handler     (or PORT=8080 with no RUNPOD_WEBHOOK_GET_JOB: Settings.endpoint_mode)

The server listens on PORT (80) before the engine exists, and builds it on a thread:
  GET  HEALTH_CHECK_PATH (/ping; on PORT_HEALTH when that differs): 204 while starting, 200 ready, 503 when the
       start failed, the engine faulted, or the worker is shutting down
  POST /v1/chat/completions | /v1/completions | /v1/responses | /v1/embeddings | /v1/messages (Anthropic's),
       GET /v1/models, POST /tokenize |
       /detokenize (also under /openai/): the queue path's routes, in this process, an SSE event per engine step
  POST /run | /runsync, GET /status/{id} | /stream/{id}, POST /cancel/{id}: worker-vllm's job body, answered as a
       queue endpoint would (a client polling /status/{id} must pin this worker: X-Runpod-Worker-Id below)
  GET  /metrics: Prometheus' text format (handler/metrics.py)
Every job goes through the same Worker.handle as on a queue endpoint (handler/job_front.py records it), so
validation, errors, LoRA, structured output and tool calls are the queue path's own.

No queue: at most MAX_CONCURRENCY requests run and LB_MAX_WAITING wait (handler/admission.py); past that, 429 with
Retry-After at once; a wait past LB_MAX_WAIT_S gets 503. A body over MAX_REQUEST_BYTES is refused (413) before it is
read. With API_KEY every route but the health check needs `Authorization: Bearer <key>` (or `x-api-key: <key>`).
Every response carries X-Runpod-Worker-Id (RUNPOD_POD_ID), which a client sends back to be routed here again (its
prefix cache).
SIGTERM: the health check, new requests and those waiting for a slot get 503 at once; running requests get
SHUTDOWN_GRACE_S, then fail with a 503 error; then the engine stops and the process exits 0. A second SIGTERM exits
at once, and so does a SIGTERM before the engine is ready (the load is not waited for). An engine fault (a step
raised or hung) drains the same way, its requests already failed, and the process exits 1 to be replaced."""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import os
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from handler import openai_compat as oa
from handler.admission import Admission, Closed, Overloaded, Ticket, WaitedTooLong
from handler.job_front import JobFront
from handler.local_jobs import Job
from handler.settings import Settings

log = logging.getLogger("handler.lb")

_TICKET: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("lb_ticket", default=None)


class TooLarge(Exception):
    pass


class LBJobs(JobFront):
    """Jobs run here, each a task draining Worker.handle into its record, as runpod's loop would: a chunk with an
    "error" fails the job with it; otherwise the job completes with every chunk (return_aggregate_stream)."""

    def __init__(self, server: LBServer):
        # /runsync waits up to Runpod's 5.5-minute request cap; /run's results are kept 5 minutes for /status
        super().__init__(runsync_wait=330.0, retention=300.0, worker_id=server.worker_id)
        self.server = server
        self.tasks: dict[str, asyncio.Task] = {}

    def refusal(self) -> str | None:
        return self.server.unavailable()

    async def body(self, request: Request) -> bytes:
        limit, out = self.server.settings.MAX_REQUEST_BYTES, bytearray()
        async for part in request.stream():  # a chunked body has no Content-Length to check first
            out += part
            if len(out) > limit:
                raise TooLarge
        return bytes(out)

    def dispatch(self, job: Job) -> None:
        ticket = _TICKET.get()
        if ticket is not None:
            ticket.taken = True  # the job's task leaves it
        self.tasks[job.id] = asyncio.create_task(self._run(job, ticket))

    def withdraw(self, job: Job, was: str) -> None:
        if (task := self.tasks.get(job.id)) is not None:
            task.cancel()  # CancelledError in Worker.handle: it aborts the engine request

    async def _run(self, job: Job, ticket: Ticket | None) -> None:
        t0 = time.monotonic()
        job.status, job.started = "IN_PROGRESS", t0
        job.changed.fire()
        error: Any = None
        try:
            async for chunk in self.server.worker.handle({"id": job.id, "input": job.input}):
                if isinstance(chunk, dict) and chunk.get("error"):
                    error = str(chunk["error"])
                    break
                job.chunks.append(chunk)
                job.changed.fire()
            if error is None:
                self.finish(job, "COMPLETED", list(job.chunks))
            else:
                self.finish(job, "FAILED", error=error)
        except asyncio.CancelledError:
            self.finish(job, "CANCELLED")  # (cancel() has already said so)
        except Exception as e:  # noqa: BLE001 - Worker.handle turns failures into error chunks; this is a bug
            log.exception("job %s failed", job.id)
            self.finish(job, "FAILED", error=f"internal error: {type(e).__name__}: {e}")
        finally:
            self.tasks.pop(job.id, None)
            if isinstance(job.input, dict) and "openai_route" in job.input:
                self.jobs.pop(job.id, None)  # its response holds it; no one asks /status for it
            if ticket is not None:
                self.server.admission.observe(time.monotonic() - t0)
                ticket.leave()


class LBServer:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.worker_id = settings.RUNPOD_POD_ID or f"{socket.gethostname()}-{os.getpid()}"
        self.worker = None  # handler.worker.Worker, once built
        self.state = "initializing"  # -> ready | failed; -> shutting down
        self.admission = Admission(settings.MAX_CONCURRENCY, settings.LB_MAX_WAITING, settings.LB_MAX_WAIT_S)
        self.jobs = LBJobs(self)
        self.metrics = None  # handler.metrics.Metrics, with the worker
        self.servers: list[uvicorn.Server] = []
        self._drain: asyncio.Task | None = None

    # ---- state
    def unavailable(self) -> str | None:
        """Why no request can run now (None: they can)."""
        if self.state == "ready" and self.worker is not None and self.worker.fault:
            return f"the engine faulted: {self.worker.fault}"
        return {
            "initializing": "the worker is still starting",
            "failed": f"the worker could not start: {self.worker and self.worker.start_error}",
            "shutting down": "the worker is shutting down",
        }.get(self.state)

    async def build(self, build_worker, started) -> None:
        """The engine, built on a thread while the server answers (handler/__main__.py's build_worker, started)."""
        worker = await _on_daemon_thread(build_worker)  # a SIGTERM meanwhile exits without waiting for it
        if worker.engine is not None:
            from handler.metrics import AdmissionCollector, Metrics

            self.metrics = Metrics(worker.engine, worker.served_name)
            self.metrics.registry.register(AdmissionCollector(self.admission, worker.served_name))
            worker.use_metrics(self.metrics)
        loop = asyncio.get_running_loop()
        worker.on_fatal = lambda: loop.call_soon_threadsafe(self.on_signal, "engine fault")  # 503, drain, exit 1
        self.worker = started(worker)
        if self.state == "initializing":
            self.state = "ready" if worker.engine is not None else "failed"
            worker.ready()  # the cold-start table
        log.info("load-balancing worker %s: %s", self.worker_id, self.state)

    # ---- routes
    async def ping(self, request: Request) -> Response:
        if self.state == "initializing":
            return Response(status_code=204)
        # unhealthy but serving (its steps keep running out of memory): out of routing, the requests here finish
        why = self.unavailable() or (self.worker.unhealthy if self.worker is not None else None)
        if why is None:
            return JSONResponse({"status": "ready", "workerId": self.worker_id})
        return JSONResponse({"status": "unhealthy", "reason": why}, 503)

    async def metrics_route(self, request: Request) -> Response:
        if self.metrics is None:
            return Response(b"", media_type="text/plain")
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    def admitted(self, route):
        """A route that runs a job: 503 unless ready, then one of the admission's slots."""

        async def endpoint(request: Request) -> Response:
            if why := self.unavailable():
                self.admission.refused["unavailable"] += 1
                return _error(f"{why}; send the request again", 503, "server_error", "unavailable")
            try:
                ticket = self.admission.enter()
            except Overloaded as e:
                headers = {"Retry-After": str(e.retry_after_s)}
                return _error(str(e), 429, "rate_limit_error", "worker_busy", headers)
            except Closed as e:
                return _error(f"{e}; send the request again", 503, "server_error", "unavailable")
            token = _TICKET.set(ticket)
            try:
                await ticket.wait()  # a drain (SIGTERM, a fault) turns the waiters away at once: Closed
                out = await route(request)
                return out if isinstance(out, Response) else JSONResponse(out)
            except Closed as e:
                return _error(f"{e}; send the request again", 503, "server_error", "unavailable")
            except WaitedTooLong as e:
                return _error(str(e), 503, "server_error", "waited_too_long")
            except TooLarge:
                return self.too_large()
            finally:
                _TICKET.reset(token)
                if not ticket.taken:  # no job took it (the request was refused before one started)
                    ticket.leave()

        return endpoint

    async def free(self, request: Request, route) -> Response:
        if why := self.unavailable():
            return _error(f"{why}; send the request again", 503, "server_error", "unavailable")
        try:
            return await route(request)
        except TooLarge:
            return self.too_large()

    def too_large(self) -> Response:
        n = self.settings.MAX_REQUEST_BYTES
        return _error(f"the request body is over MAX_REQUEST_BYTES={n} bytes", 413, code="request_too_large")

    # ---- shutdown
    def on_signal(self, why: str = "SIGTERM") -> None:
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self.drain(why))
        else:  # a second signal: now
            for s in self.servers:
                s.should_exit = s.force_exit = True

    async def drain(self, why: str = "SIGTERM") -> None:
        """SIGTERM, or an engine fault (its requests fail at once; the process then exits 1 to be replaced)."""
        grace = self.settings.SHUTDOWN_GRACE_S
        log.info("%s: /ping answers 503; %d requests running get %g s", why, len(self.jobs.tasks), grace)
        self.state = "shutting down"
        self.admission.close(self.unavailable() or "the worker is shutting down")  # the waiters: 503 now
        deadline = time.monotonic() + grace
        while self.jobs.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.jobs.tasks and self.worker is not None:
            self.worker.end_all(
                f"the worker is shutting down (SIGTERM) and this request did not finish within its {grace:g} s grace "
                "period; send it again"
            )
            await asyncio.wait(list(self.jobs.tasks.values()), timeout=5)
        await asyncio.sleep(0.2)  # the last responses out
        for s in self.servers:
            s.should_exit = True


def _on_daemon_thread(fn) -> asyncio.Future:
    """fn() on a daemon thread, as a future of this loop: unlike asyncio.to_thread (the loop's executor, which
    asyncio.run joins at its end), nothing waits for it when the server stops first."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed: the server stopped before the build ended
            pass

    threading.Thread(target=run, name="engine-build", daemon=True).start()
    return fut


def _error(message: str, status: int, kind: str = "invalid_request_error", code: str | None = None, headers=None):
    return JSONResponse(oa.error(message, kind, None, code), status, headers=headers)


class _Server(uvicorn.Server):
    """SIGTERM and SIGINT start the server's drain (LBServer.drain) instead of uvicorn's own exit."""

    def __init__(self, config: uvicorn.Config, lb: LBServer):
        super().__init__(config)
        self.lb = lb

    def handle_exit(self, sig: int, frame: Any) -> None:
        asyncio.get_event_loop().call_soon_threadsafe(self.lb.on_signal)


class _Guard:
    """ASGI middleware: X-Runpod-Worker-Id on every response; API_KEY on every route but the health check; a body
    whose Content-Length is over MAX_REQUEST_BYTES refused before it is read."""

    def __init__(self, app, lb: LBServer):
        self.app, self.lb = app, lb
        key = lb.settings.API_KEY
        self.key = key.get_secret_value().encode() if key else None
        self.health = lb.settings.HEALTH_CHECK_PATH

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        worker = (b"x-runpod-worker-id", self.lb.worker_id.encode())

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), worker]
            await send(message)

        headers = dict(scope["headers"])
        refusal = None
        if self.key is not None and scope["path"] != self.health:
            bearer, given = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")  # OpenAI's; Anthropic's
            if not (hmac.compare_digest(bearer, b"Bearer " + self.key) or hmac.compare_digest(given, self.key)):
                message = "a valid API key is required: Authorization: Bearer <API_KEY>"
                refusal = _error(message, 401, "authentication_error", "invalid_api_key")
        length = headers.get(b"content-length", b"0")
        if refusal is None and length.isdigit() and int(length) > self.lb.settings.MAX_REQUEST_BYTES:
            refusal = self.lb.too_large()
        if refusal is not None:
            return await refusal(scope, receive, send_with_id)
        return await self.app(scope, receive, send_with_id)


def create_app(lb: LBServer) -> FastAPI:
    app = FastAPI(title="rp-llm-worker (load-balancing endpoint)", docs_url=None, redoc_url=None, openapi_url=None)
    jobs = lb.jobs
    openai = lb.admitted(jobs.openai)

    async def free(request: Request) -> Response:  # no job slot: the model list, (de)tokenizing
        return await lb.free(request, jobs.openai)

    for prefix in ("", "/openai"):
        app.router.add_route(f"{prefix}/v1/chat/completions", openai, methods=["POST"])
        app.router.add_route(f"{prefix}/v1/completions", openai, methods=["POST"])
        app.router.add_route(f"{prefix}/v1/responses", openai, methods=["POST"])
        app.router.add_route(f"{prefix}/v1/embeddings", openai, methods=["POST"])
        app.router.add_route(f"{prefix}/v1/messages", openai, methods=["POST"])  # Anthropic's
        app.router.add_route(f"{prefix}/v1/messages/count_tokens", free, methods=["POST"])
        app.router.add_route(f"{prefix}/v1/models", free, methods=["GET"])
        app.router.add_route(f"{prefix}/tokenize", free, methods=["POST"])
        app.router.add_route(f"{prefix}/detokenize", free, methods=["POST"])
        # the rest: 404 or 405 in OpenAI's shape, listing the routes
        app.router.add_route(
            f"{prefix}/v1/{{rest:path}}", jobs.openai, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]
        )
    app.router.add_route("/run", lb.admitted(jobs.run), methods=["POST"])
    app.router.add_route("/runsync", lb.admitted(jobs.runsync), methods=["POST"])
    for path, endpoint, method in [
        ("/status/{job_id}", jobs.status, "GET"),
        ("/stream/{job_id}", jobs.stream, "GET"),
        ("/cancel/{job_id}", jobs.cancel_route, "POST"),
    ]:
        app.add_api_route(path, endpoint, methods=[method])
    app.router.add_route("/metrics", lb.metrics_route, methods=["GET"])
    app.router.add_route(lb.settings.HEALTH_CHECK_PATH, lb.ping, methods=["GET"])
    return app


def ports(settings: Settings) -> tuple[int, int | None]:
    """The server's port, and the health check's own port where it differs (None: the same)."""
    port = settings.PORT or 80
    return port, (settings.PORT_HEALTH if settings.PORT_HEALTH not in (None, port) else None)


def serve(settings: Settings, build_worker, started) -> int | None:
    """Run the load-balancing server until SIGTERM; 0 once drained, 1 after an engine fault, None when it stopped
    before the engine was built (the caller exits at once: the load goes on, on its thread). build_worker() ->
    Worker runs on a thread while the server answers; started(worker) ends the start (handler/__main__.py's)."""
    lb = LBServer(settings)
    port, health = ports(settings)
    log.info("serving on port %d, health check %s on port %d", port, settings.HEALTH_CHECK_PATH, health or port)
    opts = dict(host="0.0.0.0", log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=3)
    lb.servers = [_Server(uvicorn.Config(_Guard(create_app(lb), lb), port=port, **opts), lb)]
    if health is not None:
        only_ping = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        only_ping.router.add_route(settings.HEALTH_CHECK_PATH, lb.ping, methods=["GET"])
        lb.servers.append(_Server(uvicorn.Config(_Guard(only_ping, lb), port=health, **opts), lb))

    async def main() -> bool:
        build = asyncio.create_task(lb.build(build_worker, started))
        try:
            await asyncio.gather(*(s.serve() for s in lb.servers))
        finally:
            if build.done() and lb.worker is not None and lb.worker.engine is not None:
                await asyncio.to_thread(lb.worker.engine.shutdown)
        return build.done()

    try:
        import uvloop

        built = uvloop.run(main())
    except ImportError:
        built = asyncio.run(main())
    if not built:
        return None
    return 1 if lb.worker is not None and lb.worker.fault else 0
