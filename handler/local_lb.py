"""Local Runpod emulator, load-balancing endpoint: Runpod's load balancer in front of N worker processes.

    python -m handler.local --lb [--workers 2] [--port 8000] [--worker-wait 120] [--strict-wait 300] [--grace 10]

Each worker is --worker-cmd (python -m handler) with RUNPOD_ENDPOINT_TYPE=lb, its own free PORT and
RUNPOD_POD_ID=local-lb-worker-<i> (handler/lb.py). Its GET /ping, every 0.2 s: 204 or no answer yet = initializing,
200 = ready, anything else = unhealthy; or exited (not restarted). GET /health is the router's own (each worker's
id, port, pid, state, requests in flight; totals); any other request goes to one ready worker (method, path, query,
headers less hop-by-hop ones, body) and its answer streams back as it comes, SSE token by token, status and headers
kept. A client that leaves closes the worker's response, so the worker aborts the request.
  routing: the ready worker with the fewest requests in flight through here; none ready: the request waits up to
    --worker-wait s (Runpod: about 2 minutes), then 503 {"error": "no workers available"}. A worker's 429 (full:
    nothing is queued) goes back to the client, Retry-After and all.
  request header X-Runpod-Worker-Id: "<id>" = soft affinity: that worker if it is ready and not full (a 429), else
    normal routing; "strict <id>" | "strict-resume <id>": that worker only, retried while it is full or not ready
    for up to --strict-wait s (Runpod: about 5 minutes), then 400 {"error": "timed out waiting for worker"}; 404
    {"error": "affinity_worker_gone"} if there is no such worker (or it exited).
Every answer carries X-Runpod-Worker-Id: the worker's own, or set here on answers made for a worker.
SIGTERM/SIGINT: every worker is SIGTERMed; what is left after --grace s is SIGKILLed with its process group.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
import shlex
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from handler.local_jobs import Pulse, log_changes
from handler.local_worker import pdeathsig, reap_group
from handler.settings import inherited_env

log = logging.getLogger("handler.local")

HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer", b"trailers",
       b"transfer-encoding", b"upgrade", b"host"}  # fmt: skip
NOT_FORWARDED = HOP | {b"content-length", b"x-runpod-worker-id"}  # httpx sets the length; the id is ours
WORKER_ID = b"x-runpod-worker-id"
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


@dataclass(eq=False)
class Worker:
    id: str  # its RUNPOD_POD_ID
    port: int
    state: str = "initializing"  # -> ready | unhealthy -> exited
    inflight: int = 0  # requests sent to it whose answer is not over yet
    requests: int = 0
    proc: asyncio.subprocess.Process | None = None
    spawned: float = 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _affinity(header: str) -> tuple[str | None, str]:
    """X-Runpod-Worker-Id -> (None | "soft" | "strict", worker id)."""
    parts = header.split()
    if len(parts) == 2 and parts[0].lower() in ("strict", "strict-resume"):
        return "strict", parts[1]
    return ("soft" if header.strip() else None), header.strip()


class _ClientLeft(Exception):
    pass


class _Relay(StreamingResponse):
    """The worker's answer, streamed through; afterwards (done, failed, or the client left) the worker's response
    is closed, so it sees the disconnect, and the request is no longer in flight."""

    def __init__(self, upstream: httpx.Response, headers: list, worker: Worker) -> None:
        super().__init__(upstream.aiter_raw(), upstream.status_code)
        self.raw_headers, self.upstream, self.worker = headers, upstream, worker

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.worker.inflight -= 1
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()


class Router:
    def __init__(self, cmd: list[str], n: int, *, worker_wait=120.0, strict_wait=300.0, grace=10.0, every=0.2):
        self.cmd, self.worker_wait, self.strict_wait, self.grace = cmd, worker_wait, strict_wait, grace
        self.every = every  # s between health checks
        self.env = {k: v for k, v in inherited_env().items() if not k.startswith("RUNPOD_WEBHOOK_")}
        self.env.pop("PORT_HEALTH", None)  # the health check on each worker's own port
        self.health_path = self.env.get("HEALTH_CHECK_PATH") or "/ping"
        self.workers = [Worker(f"local-lb-worker-{i}", free_port()) for i in range(n)]
        self.by_id = {w.id: w for w in self.workers}
        self.ready = Pulse()
        self.totals: collections.Counter = collections.Counter()  # answers by HTTP status
        self.shutting_down = False
        self.client: httpx.AsyncClient | None = None
        self.tasks: list[asyncio.Task] = []

    # ---------------------------------------------------------------- workers
    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(None, connect=5.0)  # a generation may take minutes
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
        self.tasks = [asyncio.create_task(self._watch(w)) for w in self.workers]
        self.tasks.append(asyncio.create_task(log_changes(self._summary)))

    async def _watch(self, w: Worker) -> None:
        env = {**self.env, "RUNPOD_ENDPOINT_TYPE": "lb", "PORT": str(w.port), "RUNPOD_POD_ID": w.id,
               "LOCAL_EMULATOR": "1", "PYTHONUNBUFFERED": self.env.get("PYTHONUNBUFFERED", "1")}  # fmt: skip
        w.spawned = time.monotonic()
        # as local_worker.spawn_worker: its own session (reaped as one group), SIGTERMed if we die
        err = sys.stderr.fileno()
        w.proc = await asyncio.create_subprocess_exec(*self.cmd, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                      stdout=err, stderr=err, start_new_session=True,
                                                      preexec_fn=pdeathsig())  # fmt: skip
        log.info("%s started (pid %d, port %d): %s", w.id, w.proc.pid, w.port, shlex.join(self.cmd))
        if self.shutting_down:
            w.proc.send_signal(signal.SIGTERM)
        exited = asyncio.ensure_future(w.proc.wait())
        while not exited.done():
            if not self.shutting_down:
                self._set(w, await self._ping(w))
            await asyncio.wait([exited], timeout=self.every)
        reap_group(w.proc.pid)
        self._set(w, "exited", f" with code {w.proc.returncode}")

    async def _ping(self, w: Worker) -> str:
        try:
            r = await self.client.get(f"http://127.0.0.1:{w.port}{self.health_path}", timeout=5.0)
        except httpx.HTTPError:
            return "initializing" if w.state == "initializing" else "unhealthy"
        return {200: "ready", 204: "initializing"}.get(r.status_code, "unhealthy")

    def _set(self, w: Worker, state: str, why: str = "") -> None:
        if state == w.state:
            return
        level = {"exited": logging.ERROR, "unhealthy": logging.WARNING}.get(state, logging.INFO)
        age = time.monotonic() - w.spawned
        log.log(logging.INFO if self.shutting_down else level, "%s (port %d): %s -> %s%s, %.1f s after spawn",
                w.id, w.port, w.state, state, why, age)  # fmt: skip
        w.state = state
        if state == "ready":
            self.ready.fire()

    def begin_shutdown(self) -> None:
        if not self.shutting_down:
            self.shutting_down = True
            for w in self.workers:
                if w.proc is not None and w.proc.returncode is None:
                    w.proc.send_signal(signal.SIGTERM)

    async def stop(self) -> None:
        self.begin_shutdown()
        live = [w for w in self.workers if w.proc is not None and w.proc.returncode is None]
        if live:
            await asyncio.wait([asyncio.ensure_future(w.proc.wait()) for w in live], timeout=self.grace)
        for w in live:
            if w.proc.returncode is None:
                log.warning("%s ignored SIGTERM for %g s: SIGKILL", w.id, self.grace)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(w.proc.pid, signal.SIGKILL)
        await asyncio.wait(self.tasks[: len(self.workers)], timeout=5.0)  # the watchers: each reaps its worker's group
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.client.aclose()
        log.info("stopped. %s", self._summary())

    def _summary(self) -> str:
        workers = " ".join(f"{w.id}={w.state}/{w.requests}" for w in self.workers)
        answers = " ".join(f"{k}={v}" for k, v in sorted(self.totals.items()))
        return f"workers (state/requests): {workers} | answers: {answers or '-'}"

    # ---------------------------------------------------------------- routing
    def pick(self, skip=()) -> Worker | None:
        ready = [w for w in self.workers if w.state == "ready" and w not in skip]
        return min(ready, key=lambda w: (w.inflight, w.requests), default=None)

    async def proxy(self, request: Request) -> Response:
        try:
            out = await self._route(request)
        except _ClientLeft:
            out = Response(status_code=499)  # nginx's "client closed request": no one reads it
        self.totals[out.status_code] += 1
        return out

    async def _route(self, request: Request) -> Response:
        kind, target = _affinity(request.headers.get("x-runpod-worker-id", ""))
        path = (request.scope.get("raw_path") or request.url.path.encode()).decode("latin-1")
        query = request.url.query
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in NOT_FORWARDED]
        fwd = (request, path + (f"?{query}" if query else ""), headers, await request.body())
        if kind == "strict":
            return await self._strict(request, target, fwd)
        skip = set()
        if kind == "soft" and (w := self.by_id.get(target)) is not None and w.state == "ready":
            if (resp := await self._send(w, fwd)) is not None:
                if resp.status_code != 429 or self.pick({w}) is None:  # its answer, or its 429 if no one else can
                    return _Relay(resp, self._headers(w, resp), w)
                await self._drop(w, resp)  # full: another worker takes the request
                skip.add(w)
        deadline = time.monotonic() + self.worker_wait
        while True:
            if (w := self.pick(skip)) is not None:
                if (resp := await self._send(w, fwd)) is not None:
                    return _Relay(resp, self._headers(w, resp), w)
                continue  # it refused the connection: now unhealthy, until its /ping says otherwise
            if (left := deadline - time.monotonic()) <= 0 or self.shutting_down:
                return self._error(503, "no workers available")
            if await request.is_disconnected():
                raise _ClientLeft
            await self.ready.wait(min(left, 1.0))

    async def _strict(self, request: Request, target: str, fwd) -> Response:
        deadline = time.monotonic() + self.strict_wait
        while True:
            w = self.by_id.get(target)
            if w is None or w.state == "exited":
                return self._error(404, "affinity_worker_gone")
            if w.state == "ready" and (resp := await self._send(w, fwd)) is not None:
                if resp.status_code != 429:
                    return _Relay(resp, self._headers(w, resp), w)
                await self._drop(w, resp)  # full: again shortly
            if time.monotonic() >= deadline or self.shutting_down:
                return self._error(400, "timed out waiting for worker", w)
            if await request.is_disconnected():
                raise _ClientLeft
            await asyncio.sleep(min(0.25, max(deadline - time.monotonic(), 0.0)))

    async def _send(self, w: Worker, fwd) -> httpx.Response | None:
        """The worker's response, its body not read yet (None: no connection). A client that leaves before the
        worker answers (a whole completion is answered at its end) cancels the request to the worker."""
        request, target, headers, body = fwd
        w.inflight += 1
        w.requests += 1
        upstream = self.client.build_request(request.method, f"http://127.0.0.1:{w.port}{target}", headers=headers,
                                             content=body)  # fmt: skip
        sending = asyncio.ensure_future(self.client.send(upstream, stream=True))
        leaving = asyncio.ensure_future(request.receive())  # the body was read: http.disconnect is all that comes
        try:
            await asyncio.wait([sending, leaving], return_when=asyncio.FIRST_COMPLETED)
            if not sending.done():
                raise _ClientLeft
            return sending.result()
        except BaseException as e:
            w.inflight -= 1
            sending.cancel()  # closes the worker's connection
            if not isinstance(e, httpx.TransportError):
                raise
            if w.state == "ready":
                self._set(w, "unhealthy", f" ({type(e).__name__})")
            return None
        finally:
            leaving.cancel()

    def _headers(self, w: Worker, resp: httpx.Response) -> list[tuple[bytes, bytes]]:
        out = [(k.lower(), v) for k, v in resp.headers.raw if k.lower() not in HOP]
        if not any(k == WORKER_ID for k, _ in out):
            out.append((WORKER_ID, w.id.encode()))
        return out

    async def _drop(self, w: Worker, resp: httpx.Response) -> None:
        w.inflight -= 1
        await resp.aclose()

    def _error(self, status: int, message: str, w: Worker | None = None) -> Response:
        return JSONResponse({"error": message}, status, headers={"X-Runpod-Worker-Id": w.id} if w else None)

    async def health(self, request: Request) -> Response:
        states = collections.Counter(w.state for w in self.workers)
        busy = sum(w.inflight > 0 for w in self.workers if w.state == "ready")
        workers = {"idle": states["ready"] - busy, "running": busy}
        workers |= {s: states[s] for s in ("ready", "initializing", "unhealthy", "exited")}
        requests = {"inFlight": sum(w.inflight for w in self.workers), "sent": sum(w.requests for w in self.workers),
                    "answers": {str(k): v for k, v in sorted(self.totals.items())}}  # fmt: skip
        each = [{"id": w.id, "port": w.port, "pid": w.proc and w.proc.pid, "state": w.state, "inFlight": w.inflight,
                 "requests": w.requests, "returncode": w.proc and w.proc.returncode} for w in self.workers]  # fmt: skip
        return JSONResponse({"workers": workers, "requests": requests, "localWorkers": each})


def create_app(router: Router) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    routes = [Route("/health", router.health, methods=["GET"]), Route("/{path:path}", router.proxy, methods=METHODS)]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.router = router
    return app


class _Server(uvicorn.Server):
    """Begins the router's shutdown (SIGTERM to the workers) on the signal itself."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_soon_threadsafe(self.config.app.state.router.begin_shutdown)
        super().handle_exit(sig, frame)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of --lb (beyond --workers), on handler/local.py's parser."""
    g = ap.add_argument_group("load-balancing endpoint (--lb)")
    g.add_argument("--worker-wait", type=float, default=120.0, help="s a request waits for a ready worker (120)")
    g.add_argument("--strict-wait", type=float, default=300.0, help="s strict affinity waits for its worker (300)")
    g.add_argument("--grace", type=float, default=10.0, help="s the workers get after SIGTERM, then SIGKILL (10)")


def serve(args: argparse.Namespace) -> None:
    """handler/local.py's main with --lb: the router and its workers until SIGTERM/SIGINT."""
    if args.workers < 1:
        raise SystemExit("--workers must be at least 1")
    router = Router(shlex.split(args.worker_cmd), args.workers, worker_wait=args.worker_wait,
                    strict_wait=args.strict_wait, grace=args.grace)  # fmt: skip
    log.info("load-balancing endpoint on http://%s:%d, %d workers", args.host, args.port, args.workers)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    # no Server or Date header of our own: the worker's pass through. Requests in flight get --grace s to finish.
    config = uvicorn.Config(create_app(router), host=args.host, port=args.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=args.grace, server_header=False, date_header=False)  # fmt: skip
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the SIGINT again once it has stopped
        _Server(config).run()
