"""Local Runpod emulator: Runpod's public endpoint API in front, the SDK's real worker loop behind.

    python -m handler.local --port 8000 [--host 127.0.0.1] [--worker-cmd "python -m handler"]
    python -m handler.local --lb --workers 2 --port 8000: a load-balancing endpoint instead (handler/local_lb.py)

Front, endpoint id ``local``: ``runpod.Endpoint("local")`` (``runpod.endpoint_url_base = "http://H:P/v2"``)
and the ``openai`` client (``base_url="http://H:P/v2/local/openai/v1"``) work unmodified.
  POST /v2/local/run | /runsync (waits --runsync-wait s, then answers {"id", "status": "IN_PROGRESS"})
  GET  /v2/local/status/{id} | /stream/{id} (chunks since the last poll, long-polled --stream-wait s)
  POST /v2/local/cancel/{id} | /purge-queue    GET /v2/local/health
  POST .../openai/v1/chat/completions | /completions, GET .../openai/v1/models (openai_compat.ROUTES) become jobs
  with input {"openai_route": "/v1/...", "openai_input": body ({} for models)}. With "stream": true the job's
  chunks (SSE text) pass through verbatim, with the job's id in an X-Job-Id header; else the single yielded object
  is the body. Errors are OpenAI's {"error": {"message", "type", "param", "code"}}, with the job error's "status"
  as HTTP status (crashes 500); mid-stream, one such event and [DONE]. Any other route under .../openai/ is a 404
  (a wrong method a 405) in that shape, listing the routes. A client that leaves cancels. /status adds
  "streamPosts": the worker's job-stream POSTs for the job so far.

Back: the worker subprocess runs runpod-python's JobScaler against the routes described in local_worker.py.
Worker output goes to our stderr. If it exits, its running jobs fail (queued ones too unless
--restart-worker). "ready" is logged at its first job-take, request counts every 30 s and at exit.
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
import sys
import time
from typing import Any

import uvicorn
from fastapi import FastAPI

from handler import local_lb
from handler.job_front import JobFront
from handler.local_jobs import EP, Job, Pulse, log_changes
from handler.local_worker import WorkerSide

log = logging.getLogger("handler.local")


class Emulator(JobFront, WorkerSide):
    def __init__(
        self,
        worker_cmd: list[str],
        base_url: str,
        *,
        runsync_wait: float = 90.0,
        stream_wait: float = 1.0,
        poll_hold: float = 10.0,
        restart: bool = False,
        grace: float = 5.0,
        retention: float = 900.0,
    ) -> None:
        super().__init__(runsync_wait=runsync_wait, stream_wait=stream_wait, retention=retention)
        self.worker_cmd, self.base, self.restart, self.grace = worker_cmd, base_url, restart, grace
        self.poll_hold = poll_hold
        self.queue: collections.deque[str] = collections.deque()
        self.stops: list[str] = []
        self.queue_pulse, self.stop_pulse = Pulse(), Pulse()
        self.proc: asyncio.subprocess.Process | None = None
        self.state = "initializing"  # -> ready -> exited
        self.spawned = self.last_ping = None
        self.shutting_down = False
        self.tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ jobs (JobFront's hooks)
    def refusal(self) -> str | None:
        if self.shutting_down or (self.state == "exited" and not self.restart):
            return f"local worker is not running ({self.state})"
        return None

    def dispatch(self, job: Job) -> None:
        self.queue.append(job.id)
        self.queue_pulse.fire()

    def withdraw(self, job: Job, was: str) -> None:
        if was == "IN_QUEUE":
            self.queue.remove(job.id)
        if was == "IN_PROGRESS" and job.id not in self.stops:
            self.stops.append(job.id)
            self.stop_pulse.fire()

    # ---------------------------------------------------------------- worker
    async def start(self) -> None:
        self.tasks = [asyncio.create_task(log_changes(self._summary)), asyncio.create_task(self._run_worker())]

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
            "jobs": {
                "completed": self.totals["COMPLETED"],
                "failed": self.totals["FAILED"],
                "cancelled": self.totals["CANCELLED"],
                "inProgress": running,
                "inQueue": len(self.queue),
                "retried": 0,
            },
            "workers": {
                "idle": int(ready and not running),
                "running": int(ready and running > 0),
                "ready": int(ready),
                "initializing": int(self.state == "initializing"),
                "throttled": 0,
                "unhealthy": int(self.state == "exited"),
            },
            "localWorker": {
                "state": self.state,
                "pid": self.proc and self.proc.pid,
                "returncode": self.proc and self.proc.returncode,
                "requests": dict(self.counts),
                "lastPingAgoS": self.last_ping and round(time.monotonic() - self.last_ping, 1),
            },
        }


def create_app(worker_cmd: list[str] | str, *, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> FastAPI:
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
    routes = [
        ("POST", "/run", emu.run),
        ("POST", "/runsync", emu.runsync),
        ("GET", "/status/{job_id}", emu.status),
        ("GET", "/stream/{job_id}", emu.stream),
        ("POST", "/cancel/{job_id}", emu.cancel_route),
        ("POST", "/purge-queue", emu.purge_queue),
        ("GET", "/health", emu.health),
    ]
    for method, path, endpoint in routes:
        app.add_api_route(f"/v2/{EP}{path}", endpoint, methods=[method])
    # every route under the OpenAI prefix: emu.openai serves oa.ROUTES and answers the rest in OpenAI's shape
    app.add_api_route(f"/v2/{EP}/openai/{{route:path}}", emu.openai, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    # The worker-facing routes are plain Starlette routes (request in, Response out): a streaming worker POSTs
    # once per yield, so FastAPI's per-request validation and serialization would be paid hundreds of times a
    # second, on the cores the worker computes on.
    for method, path, endpoint in [
        ("GET", "/job-take/{worker_id}", emu.job_take),
        ("GET", "/job-take-batch/{worker_id}", emu.job_take),
        ("GET", "/job-stop/{worker_id}", emu.job_stop),
        ("GET", "/ping/{worker_id}", emu.ping),
        ("POST", "/job-stream/{worker_id}/{job_id}", emu.job_result),
        ("POST", "/job-done/{worker_id}/{job_id}", emu.job_result),
    ]:
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
    ap.add_argument(
        "--worker-cmd",
        default=f"{shlex.quote(sys.executable)} -m handler",
        help="the worker command line (default: %(default)s)",
    )
    ap.add_argument("--restart-worker", action="store_true", help="restart the worker when it exits")
    ap.add_argument("--runsync-wait", type=float, default=90.0, help="seconds /runsync waits (90)")
    ap.add_argument("--stream-wait", type=float, default=1.0, help="seconds /stream long-polls (1)")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--lb", action="store_true", help="a load-balancing endpoint: a router in front of --workers")
    ap.add_argument("--workers", type=int, default=1, help="with --lb: how many workers (1)")
    local_lb.add_arguments(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level.upper(), format="%(asctime)s local-rp | %(message)s", datefmt="%H:%M:%S"
    )
    if args.lb:
        return local_lb.serve(args)
    app = create_app(
        args.worker_cmd,
        host=args.host,
        port=args.port,
        runsync_wait=args.runsync_wait,
        stream_wait=args.stream_wait,
        restart=args.restart_worker,
    )
    _Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", access_log=False, timeout_graceful_shutdown=3
        )
    ).run()


if __name__ == "__main__":
    main()
