"""The emulator's job records and the pieces it shares with its routes: job state, wake-ups, the
worker's environment, strict JSON bodies, SSE framing, and OpenAI responses.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from handler import openai_compat as oa

log = logging.getLogger("handler.local")

EP, WORKER_ID = "local", "local-worker"
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT")


class Pulse:
    """A broadcast wake-up: every pending ``wait`` returns True when ``fire`` is called."""

    def __init__(self) -> None:
        self._ev = asyncio.Event()

    def fire(self) -> None:
        self._ev.set()
        self._ev = asyncio.Event()

    async def wait(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._ev.wait(), max(timeout, 0.0))
            return True
        except asyncio.TimeoutError:
            return False


@dataclass
class Job:
    id: str
    input: Any
    status: str = "IN_QUEUE"
    output: Any = None
    error: Any = None
    chunks: list = field(default_factory=list)
    stream_pos: int = 0  # cursor of the public /stream endpoint
    created: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    changed: Pulse = field(default_factory=Pulse)
    worker_id: str = WORKER_ID  # who runs it (the load-balancing server: its own id)

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def public(self) -> dict:
        now = time.monotonic()
        out = {"id": self.id, "status": self.status, "delayTime": int(((self.started or now) - self.created) * 1e3)}
        if self.started is not None:
            out |= {
                "executionTime": int(((self.finished or now) - self.started) * 1e3),
                "workerId": self.worker_id,
                "streamPosts": len(self.chunks),
            }  # an emulator extension: one chunk per job-stream POST
        if self.output is not None:
            out["output"] = self.output
        if self.error is not None:
            out["error"] = self.error
        return out


async def log_changes(line, every: float = 30.0) -> None:
    """Log line() every `every` seconds, when it has changed."""
    last = None
    while True:
        await asyncio.sleep(every)
        if (text := line()) != last:
            log.info("%s", last := text)


def sse(chunk: Any) -> str:
    if isinstance(chunk, str):
        return chunk
    if isinstance(chunk, list):
        return "".join(map(sse, chunk))
    return f"data: {json.dumps(chunk)}\n\n"


async def sse_events(job: Job, cancel, failed=None) -> AsyncIterator[str]:
    """A streamed OpenAI job's chunks as SSE text, as they arrive; if the client leaves first, cancel(job).
    failed(response): the last event of a stream whose job failed (default: the error and [DONE], as vLLM)."""
    pos = 0
    try:
        while True:
            while pos < len(job.chunks):
                pos += 1
                yield sse(job.chunks[pos - 1])
            if job.done:
                break
            await job.changed.wait(5.0)
        if job.status != "COMPLETED":  # failed (or cancelled) mid-stream: an error event, then [DONE], as vLLM does
            error = failure(job)
            yield failed(error) if failed else f"data: {error.body.decode()}\n\ndata: [DONE]\n\n"
    finally:
        if not job.done:
            log.info("stream client went away: cancelling %s", job.id)
            cancel(job)


def error_response(err: Any, default_status: int = 400) -> JSONResponse:
    """OpenAI's error body (openai_compat.error) from a job error: a dict, JSON text, or the SDK's str() of the dict
    a generator yielded as {"error": {...}}. The HTTP status is the object's "status" (the worker's JobError sets
    it); anything that is not an error object (a handler crash, the worker's exit) is a 500 server_error."""
    if isinstance(err, str):
        for parse in (json.loads, ast.literal_eval):
            with contextlib.suppress(Exception):
                err = parse(err)
                break
    if isinstance(err, dict) and isinstance(err.get("error"), dict):
        err = err["error"]
    if not isinstance(err, dict) or "message" not in err:
        text = err.get("error_message", json.dumps(err)) if isinstance(err, dict) else str(err)
        err, default_status = {"message": text, "type": "server_error"}, 500
    code = err.get("code")
    status = err.get("status", code if isinstance(code, int) else None)  # vLLM's objects carry it as their code
    status = status if isinstance(status, int) and 400 <= status < 600 else default_status
    param, kind = err.get("param"), err.get("type")
    if not (isinstance(kind, str) and kind):
        kind = "server_error" if status >= 500 else "invalid_request_error"
    body = oa.error(
        str(err["message"]), kind, param if isinstance(param, str) else None, code if isinstance(code, str) else None
    )
    return JSONResponse(body, status)


def failure(job: Job) -> JSONResponse:
    """A job that ended without completing, as OpenAI's error response."""
    if job.status == "CANCELLED":  # 499: nginx's "client closed request"; the cancel came from a client
        return error_response({"message": "the request was cancelled", "code": "request_cancelled", "status": 499})
    return error_response(job.error)


def json_body(raw: bytes) -> Any:
    """Strict JSON, as an HTTP API should take it: NaN, Infinity, 1e400 and lone surrogates ("\\ud800") are
    refused here (ValueError), not accepted and then impossible to pass on to the worker."""

    def finite(text: str) -> float:
        if not math.isfinite(x := float(text)):
            raise ValueError(f"{text} is out of range for a JSON number")
        return x

    def constant(name: str):
        raise ValueError(f"{name} is not JSON")

    body = json.loads(raw, parse_float=finite, parse_constant=constant)
    json.dumps(body, ensure_ascii=False).encode("utf-8")  # UnicodeEncodeError (a ValueError) on a lone surrogate
    return body


def openai_result(job: Job) -> JSONResponse:
    """A finished (non-streamed) OpenAI job as its HTTP response: the body, or the error in OpenAI's shape."""
    if job.status != "COMPLETED":
        return failure(job)
    out = job.output[0] if isinstance(job.output, list) and len(job.output) == 1 else job.output
    if isinstance(out, dict) and (out.get("error") or out.get("object") == "error"):  # (a response has error: null)
        return error_response(out)
    return JSONResponse(out)
