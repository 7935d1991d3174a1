"""Timestamps along a job's path to its first token, for bench/latency.py.

    python -m bench._trace emulator --port P [--worker-cmd ...]    # handler.local, traced
    python -m bench._trace worker                                   # python -m handler, traced

Each entry point is the real one; this only wraps a few functions on the path and appends
`[event, job id, time.time()]` JSON lines to $TRACE_FILE (the processes share the machine's clock). With
TRACE_SDK_LOOP=original the worker runs runpod's own JobScaler.run (its 100 ms run_jobs poll) instead of ours.
Events: submit, taken, post_in, sse_out (emulator); sdk_got, handler_start, engine_submit, engine_first,
handler_yield, post_start, post_end (worker)."""

from __future__ import annotations

import functools
import json
import os
import sys
import time


def emit(event: str, key) -> None:
    with open(os.environ["TRACE_FILE"], "a") as f:
        f.write(json.dumps([event, key, time.time()]) + "\n")


def first_yield(agen_fn, on_start, on_first):
    """Wrap an async generator function: call on_start(args) at entry and on_first(args) at its first yield."""

    @functools.wraps(agen_fn)
    async def wrapper(*args, **kw):
        on_start(args)
        first = True
        async for item in agen_fn(*args, **kw):
            if first:
                first = False
                on_first(args)
            yield item

    return wrapper


def trace_emulator() -> None:
    from handler import job_front, local

    emu = local.Emulator
    submit, take, result = emu.submit, emu.job_take, emu.job_result

    def traced_submit(self, *a, **kw):
        job = submit(self, *a, **kw)
        emit("submit", job.id)
        return job

    async def traced_take(self, request):
        response = await take(self, request)
        if response.status_code == 200:
            body = json.loads(response.body)
            for job in body if isinstance(body, list) else [body]:
                emit("taken", job["id"])
        return response

    async def traced_result(self, request):
        if "/job-stream/" in request.url.path:
            emit("post_in", request.path_params["job_id"])
        return await result(self, request)

    emu.submit, emu.job_take, emu.job_result = traced_submit, traced_take, traced_result
    # the OpenAI routes' event stream (handler/local_jobs.py), as handler/job_front.py calls it
    job_front.sse_events = first_yield(job_front.sse_events, lambda a: None, lambda a: emit("sse_out", a[0].id))


def trace_worker() -> None:
    from engine import AsyncEngine
    from handler import runpod_sdk
    from handler import worker as w

    W = w.Worker
    W.handle = first_yield(
        W.handle, lambda a: emit("handler_start", a[1]["id"]), lambda a: emit("handler_yield", a[1]["id"])
    )

    gen = AsyncEngine.generate

    async def traced_generate(self, prompt, params=None, request_id=None, lora=None):
        job = str(request_id).split("/", 1)[0].rsplit("#", 1)[0]  # the worker's "{job id}#{n}" ("/{i}": a batch)
        emit("engine_submit", job)
        first = True
        async for out in gen(self, prompt, params, request_id, lora):
            if first and any(c.delta_token_ids for c in out.outputs):
                first = False
                emit("engine_first", job)
            yield out

    AsyncEngine.generate = traced_generate

    install = runpod_sdk.install

    def traced_install(*a, **kw):
        from runpod.serverless.modules import rp_job, rp_scale

        install(*a, **kw)
        get_job, stream_result = rp_scale.get_job, rp_job.stream_result

        async def traced_get_job(session, num_jobs=1):
            jobs = await get_job(session, num_jobs)
            for job in jobs or []:
                emit("sdk_got", job["id"])
            return jobs

        async def traced_stream_result(session, data, job):
            emit("post_start", job["id"])
            await stream_result(session, data, job)
            emit("post_end", job["id"])

        rp_scale.get_job, rp_job.stream_result = traced_get_job, traced_stream_result
        if os.environ.get("TRACE_SDK_LOOP") == "original":  # runpod's run(): its run_jobs polls every 100 ms
            rp_scale.JobScaler.run = rp_scale._sdk_job_scaler.run

    runpod_sdk.install = traced_install


if __name__ == "__main__":
    which, argv = sys.argv[1], sys.argv[2:]
    if which == "emulator":
        trace_emulator()
        from handler.local import main

        main(argv)
    else:
        trace_worker()
        from handler.__main__ import main

        sys.exit(main(argv))
