"""Production entry: `python -m handler`.

Builds the engine once, then hands runpod an async generator handler with return_aggregate_stream and a
concurrency_modifier. If start-up fails, the worker still starts and every job gets the reason as its
error (a worker that dies at start makes Runpod retry it forever, and callers see only a hang).

runpod's local modes: `--rp_serve_api` is runpod's own dev server (it iterates generators). For
`--test_input '{...}'` and `test_input.json`, the SDK does not iterate generator handlers, so we run the job
ourselves, print each chunk and the aggregate, and exit 0 on success and 1 on error."""

from __future__ import annotations

import gc
import time

T0 = time.perf_counter()  # the cold-start timeline counts from here (interpreter start-up, ~20 ms, is before it)
# The start makes about 300k objects that live as long as the process (torch's import alone), and nothing it makes
# is cyclic garbage worth finding: the ~400 collections they would trigger cost 0.3 s of the start here. Collection
# resumes once the worker is built, with those objects frozen out of every later collection (started()). Only as
# the program: a process that imports this module keeps its collector as it was.
if __name__ == "__main__":
    gc.disable()

import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

log = logging.getLogger("handler")


def _test_input(argv: list[str]) -> dict | None:
    if "--test_input" in argv:
        i = argv.index("--test_input")
        if i + 1 >= len(argv):
            raise SystemExit("--test_input needs a JSON argument")
        return json.loads(argv[i + 1])
    if Path("test_input.json").is_file():
        return json.loads(Path("test_input.json").read_text())
    return None


def started(worker):
    """The start is over: what it made is permanent for the collector (gc.freeze: later collections, steps' pauses
    included, skip it), and collection resumes."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
    return worker


def build_worker(per_token: bool = False, settings=None, error: str | None = None):
    """The Worker, its engine built (or the reason it could not be, for every job). per_token: streams send each
    engine step's tokens at once (the load-balancing server's own HTTP stream, no POST per yield to batch for).
    settings: already loaded (main's), else loaded here; error: why they are invalid (settings then holds only the
    serving variables: the endpoint kind, the queue's webhook)."""
    from engine import AsyncEngine, Timeline
    from handler.settings import Settings, SettingsError, load_settings, set_library_defaults
    from handler.worker import Worker

    set_library_defaults()  # before torch's first matmul
    tl = Timeline(start=T0)
    tl.mark("imports")
    if settings is None and error is None:
        try:
            settings = load_settings()
        except SettingsError as e:
            error = str(e)
    if error is not None:
        log.error("invalid settings: %s", error)
        return Worker(settings or Settings(), None, start_error=error)
    if per_token:
        one = {"DEFAULT_BATCH_SIZE": 1, "DEFAULT_MIN_BATCH_SIZE": 1, "DEFAULT_BATCH_SIZE_GROWTH_FACTOR": 1.0}
        settings = settings.model_copy(update=one)
    for item in settings.ignored():
        log.warning("%s", item)
    tl.mark("settings")
    try:
        engine = AsyncEngine(settings.engine_config(), timeline=tl, idle_held=True)  # until worker.ready()
    except Exception as e:  # model not found, bad config, out of memory: report it on every job
        log.exception("engine start failed")
        return Worker(settings, None, start_error=f"{type(e).__name__}: {e}")
    log.info("engine ready in %.1fs", tl.total())
    return Worker(settings, engine, timeline=tl)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    test_job = None if "--rp_serve_api" in argv else _test_input(argv)
    if test_job is None and "--rp_serve_api" not in argv:
        from handler.settings import serving_settings

        settings, error = serving_settings()  # invalid: build_worker reports why, on every job (and /ping: 503)
        mode, why = settings.endpoint_mode()
        log.info("%s endpoint mode: %s", "load-balancing" if mode == "lb" else "queue", why)
        if mode == "lb":
            from handler import lb

            code = lb.serve(settings, lambda: build_worker(per_token=True, settings=settings, error=error), started)
            if code is None:  # no engine to stop, and the load's thread may hold the interpreter's exit
                return exit_now("shut down before the engine was ready", code=0)
            return code if code == 0 else exit_now("the engine faulted")
        worker = started(build_worker(settings=settings, error=error))
    else:
        worker = started(build_worker())
    if test_job is not None or (worker.settings.RUNPOD_WEBHOOK_GET_JOB is None and "--rp_serve_api" not in argv):
        from handler.worker import run_test_job

        if test_job is None:
            print(
                "no job: pass --test_input '{\"input\": {...}}', add test_input.json, or run on Runpod "
                "(RUNPOD_WEBHOOK_GET_JOB) / under `python -m handler.local`",
                file=sys.stderr,
            )
            return 1
        worker.ready()
        return stopped(worker, asyncio.run(run_test_job(worker, test_job, sys.stdout)))

    from handler import runpod_sdk

    runpod_sdk.lean_import()
    import runpod

    grace = worker.settings.SHUTDOWN_GRACE_S
    runpod_sdk.install(
        grace,
        lambda: worker.end_all(
            f"the worker is shutting down (SIGTERM) and this job did not finish within its {grace:g} s grace "
            "period; send it again"
        ),
    )
    worker.ready()  # the cold-start table, before the first job-take
    worker.on_fatal = runpod_sdk.stop_worker  # an engine fault: the jobs in flight report it, then the loop ends

    runpod.serverless.start(worker.runpod_config())
    return exit_now(f"the engine faulted: {worker.fault}") if worker.fault else stopped(worker, 0)


def stopped(worker, code: int) -> int:
    """A clean exit stops the engine's step loop first. Left running, its thread may be inside torch (an idle piece:
    packing a layer's weights for oneDNN) when the interpreter finalizes, and a thread that C++ code is unwound out
    of aborts the whole process ('terminate called without an active exception', exit 134 after a good job)."""
    if worker.engine is not None and worker.fault is None:
        worker.engine.shutdown()
    return code


def exit_now(why: str, code: int = 1) -> int:
    """After an engine fault the process exits now with 1, past every exit handler (a hung step's thread, or a CUDA
    context after a device error, can hold the interpreter's exit forever), so that the platform replaces it.
    Also (code 0) a load-balancing worker told to stop while its engine loads."""
    log.log(logging.ERROR if code else logging.WARNING, "exiting: %s", why)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
