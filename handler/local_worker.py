"""The emulator's back side: the worker process and the routes its runpod SDK calls (a mixin of
local.Emulator, whose job state it shares).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from handler.local_jobs import WORKER_ID
from handler.settings import inherited_env

log = logging.getLogger("handler.local")


def _ok() -> Response:
    return Response(b"{}", media_type="application/json")


class WorkerSide:
    """Needs from the emulator: jobs, queue, stops, queue_pulse, stop_pulse, counts, state, spawned, last_ping,
    shutting_down, restart, base, worker_cmd, poll_hold, proc and finish()."""

    async def _run_worker(self) -> None:
        host, port = self.base.split("/")[2].rsplit(":", 1)
        while True:  # spawn once we accept connections: the SDK retries a refused job-take in a tight loop
            with contextlib.suppress(OSError):
                (await asyncio.open_connection(host, int(port)))[1].close()
                break
            await asyncio.sleep(0.05)
        while not self.shutting_down:
            self.state, self.spawned = "initializing", time.monotonic()
            self.proc = await spawn_worker(self.worker_cmd, self.base)
            code = await self.proc.wait()
            reap_group(self.proc.pid)
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

    async def job_take(self, request: Request) -> Response:
        self.counts["job-take"] += 1
        if self.state == "initializing":
            self.state = "ready"
            log.info(
                "ready: the worker made its first job-take %.1f s after spawn; serving %s",
                time.monotonic() - self.spawned,
                self.base,
            )
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
            log.error("worker unhealthy: %s: %s", request.query_params.get("check"), request.query_params.get("reason"))
        return _ok()


def worker_env(base: str) -> dict:
    """The environment that points the SDK's JobScaler at the emulator at ``base`` (http://h:p/v2/local)."""
    env = inherited_env()
    env.update(
        RUNPOD_WEBHOOK_GET_JOB=f"{base}/job-take/$ID?gpu=local",
        RUNPOD_WEBHOOK_POST_OUTPUT=f"{base}/job-done/$RUNPOD_POD_ID/$ID?gpu=local",
        RUNPOD_WEBHOOK_POST_STREAM=f"{base}/job-stream/$RUNPOD_POD_ID/$ID?gpu=local",
        RUNPOD_WEBHOOK_PING=f"{base}/ping/$RUNPOD_POD_ID?gpu=local",
        RUNPOD_POD_ID=WORKER_ID,
        RUNPOD_AI_API_KEY="local",
        LOCAL_EMULATOR="1",
    )  # Runpod's protocol, but not Runpod: caches stay in the user's, no /runpod-volume
    for key, value in (
        ("RUNPOD_SKIP_AUTO_SYSTEM_CHECKS", "true"),
        ("RUNPOD_SKIP_GPU_CHECK", "true"),
        ("RUNPOD_PING_INTERVAL", "5000"),
        ("RUNPOD_LOG_LEVEL", "INFO"),
        ("PYTHONUNBUFFERED", "1"),
    ):
        env.setdefault(key, value)
    return env


async def spawn_worker(cmd: list[str], base: str) -> asyncio.subprocess.Process:
    """The worker process for the emulator at `base`: its own session (so its whole group can be reaped), its
    output on our stderr, SIGTERMed if we die first."""
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        env=worker_env(base),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=sys.stderr.fileno(),
        stderr=sys.stderr.fileno(),
        start_new_session=True,
        preexec_fn=pdeathsig(),
    )
    log.info("worker started (pid %d): %s", proc.pid, shlex.join(cmd))
    return proc


def reap_group(pid: int) -> None:
    """After the worker exited: kill anything it left in its process group (there should be nothing)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, 0)  # raises when the worker's process group is gone, as it should be
        log.warning("the worker left processes behind: killing them")
        os.killpg(pid, signal.SIGKILL)


def pdeathsig() -> Any:
    """A pre-exec hook (Linux) that SIGTERMs the worker if the emulator dies without stopping it."""
    if sys.platform != "linux":
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
