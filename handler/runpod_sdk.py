"""Our fixes to runpod-python 1.12's worker loop, installed before `runpod.serverless.start`.

- `lean_import`, before `import runpod`: its import spent ~1.1 s in cpuinfo.get_cpu_info() (rp_debugger reads
  the CPU brand once), which we answer from /proc/cpuinfo; and ~0.13 s in its command-line tool's package
  (`runpod.cli`, whose __init__ imports the `ssh` group: paramiko, cryptography, invoke), which a worker never
  runs: that package stands in as an empty one over the same folder, so the one module the SDK uses from it
  (`runpod.cli.groups.config.functions`, credentials) still loads. tests/test_handler_entry.py checks both.
- `install(...)` swaps the SDK's JobScaler for a subclass with `Scaler` mixed in (runpod's worker loop builds
  `rp_scale.JobScaler(config)` at call time, so the swap is all it takes):
  - occupancy: the SDK counts a taken job twice (in its queue and in progress) until its task starts, so after
    taking 4 of 8 jobs it thought it was full and slept 1 s. The in-progress set alone is the occupancy.
  - a taken job starts at once: the SDK's run_jobs looked at its queue every 100 ms (asyncio.wait timeout /
    sleep 0.1), which added 50 ms to the mean time to first token.
  - SIGTERM (Runpod's scale-down) drains: no new job-takes, jobs in flight get `grace_s` to finish, then
    `on_grace_expired()` ends the rest with an error (the handler yields it, the SDK reports the job FAILED),
    and the process exits once every job has reported. The SDK instead waited for its job-take and job-stop
    long-polls and every job without limit, and stopped polling job-stop at SIGTERM, so a job cancelled
    while draining kept running.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("handler")
REPORT_S = 5.0  # after the grace period: time for the ended jobs to report before they are cancelled


def lean_import() -> None:
    """The shims above (module docstring), installed once; call before `import runpod`."""
    if "cpuinfo" not in sys.modules:
        brand = "unknown"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    brand = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        shim = types.ModuleType("cpuinfo")
        shim.get_cpu_info = lambda: {"brand_raw": brand}
        sys.modules["cpuinfo"] = shim
    if "runpod" not in sys.modules and (spec := importlib.util.find_spec("runpod")) is not None:
        cli = types.ModuleType("runpod.cli")
        cli.__path__ = [str(Path(spec.submodule_search_locations[0]) / "cli")]  # its subpackages, found as before
        cli.STOP_EVENT = threading.Event()  # what its __init__ defines besides the imports
        sys.modules["runpod.cli"] = cli


_current: list = []  # [(the running Scaler, its event loop)], for stop_worker


def stop_worker() -> None:
    """Take no more jobs and end the worker loop once the jobs in flight have reported (an engine fault: they fail
    with it); safe from any thread."""
    if _current:
        scaler, loop = _current[0]
        loop.call_soon_threadsafe(scaler.kill_worker)


def install(grace_s: float, on_grace_expired: Callable[[], None]) -> None:
    """Make runpod's worker loop use `Scaler` with this drain policy, on uvloop where it is installed (the loop
    handles a POST per streamed yield; uvloop does it in about half the CPU time, off the engine's GIL)."""
    from runpod.serverless.modules import rp_scale

    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())  # runpod's asyncio.run() makes the loop
    except ImportError:
        pass
    base = getattr(rp_scale, "_sdk_job_scaler", rp_scale.JobScaler)
    rp_scale._sdk_job_scaler = base
    policy = {"grace_s": grace_s, "on_grace_expired": staticmethod(on_grace_expired)}
    rp_scale.JobScaler = type("JobScaler", (Scaler, base), policy)


class Scaler:
    """Mixed in before the SDK's JobScaler by install(); `grace_s` and `on_grace_expired` are set there."""

    grace_s: float
    on_grace_expired: Callable[[], None]

    def current_occupancy(self) -> int:
        return self.job_progress.get_job_count()  # queued jobs are already in it

    def kill_worker(self) -> None:  # SIGTERM / SIGINT, or refresh_worker after a job
        if self.is_alive():
            log.info(
                "shutting down: no new jobs; %d in flight get %.0f s to finish", len(self.jobs_tasks), self.grace_s
            )
        super().kill_worker()

    async def run(self) -> None:
        from runpod.http_client import AsyncClientSession

        _current[:] = [(self, asyncio.get_running_loop())]
        async with AsyncClientSession() as session:
            take = asyncio.create_task(self.get_jobs(session))
            stops = asyncio.create_task(self.monitor_stop_signals(session))
            try:
                await self._run_jobs(session, take)
            finally:
                for t in (take, stops):
                    t.cancel()
                await asyncio.gather(take, stops, return_exceptions=True)
        log.info("worker loop done: every job has reported")

    async def _run_jobs(self, session, take: asyncio.Task) -> None:
        """Start each taken job at once; after shutdown, drain (see the module docstring)."""
        tasks: set[asyncio.Task] = set()
        getter: asyncio.Task | None = None
        queue = None
        deadline, ended = None, False
        while True:
            while len(tasks) < self.current_concurrency and not self.jobs_queue.empty():
                tasks.add(self._start(session, self.jobs_queue.get_nowait()))
            if not self.is_alive():
                if deadline is None:
                    deadline = time.monotonic() + self.grace_s
                if self.jobs_queue.empty() and not tasks:
                    if take.done():
                        break
                    take.cancel()  # idle: don't hold the exit for a long-poll
                if time.monotonic() >= deadline:
                    if not take.done():
                        take.cancel()  # a job-take held open past the grace period
                    if not ended:
                        ended = True  # the rest end with an error and report it; a job stuck even then
                        deadline += REPORT_S  # (its POST hangs) is cancelled REPORT_S later
                        if tasks:
                            log.warning("grace period over: ending %d jobs with an error", len(tasks))
                        self.on_grace_expired()
                    else:
                        for t in tasks:
                            t.cancel()
            # A get() on the current queue wakes us the moment a job is taken (set_scale may replace
            # the queue while idle: then re-arm).
            if getter is not None and (queue is not self.jobs_queue or len(tasks) >= self.current_concurrency):
                if getter.done() and not getter.cancelled():
                    tasks.add(self._start(session, getter.result()))
                else:
                    getter.cancel()
                getter = None
            if getter is None and len(tasks) < self.current_concurrency:
                queue = self.jobs_queue
                getter = asyncio.ensure_future(queue.get())
            waits = tasks | {getter} if getter is not None else set(tasks)
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED, timeout=0.1)
            if getter in done:
                tasks.add(self._start(session, getter.result()))
                getter = None
            for t in done & tasks:
                tasks.discard(t)
                if not t.cancelled() and t.exception() is not None:
                    log.error("job task failed: %r", t.exception())
        if getter is not None:
            getter.cancel()

    def _start(self, session, job: dict) -> asyncio.Task:
        task = asyncio.create_task(self.handle_job(session, job))
        self.jobs_tasks[job["id"]] = task
        return task

    async def monitor_stop_signals(self, session) -> None:
        """Poll job-stop until run() cancels this (after every job has reported, so a cancel during the
        drain still reaches its job). The floor delay only follows an answer that was not held open."""
        from runpod.http_client import TooManyRequests

        while True:
            t = time.monotonic()
            try:
                for job_id in await asyncio.wait_for(
                    self.stop_signals_fetcher(session), timeout=self.stop_signals_fetcher_timeout
                ):
                    await self.stop_job(job_id)
            except TooManyRequests:
                await asyncio.sleep(5)
            except asyncio.TimeoutError:
                pass
            except Exception as e:  # noqa: BLE001 - the platform is unreachable: retry, never die
                log.error("job-stop poll failed: %s: %s", type(e).__name__, e)
                await asyncio.sleep(1)
            if time.monotonic() - t < 0.5:
                await asyncio.sleep(0.5)
