"""When a streamed job's tokens go out. Each handler yield is one HTTP POST to the platform, so tokens are
batched per yield; this module decides the batches.

A yield goes out when its count batch is full (worker-vllm's growth: 1, 3, 9, 27, 50, ...), or when
`flush_s` has passed since the last yield and a token is pending, or when the request finishes, whichever comes
first. Count alone (worker-vllm's rule) made a 64-token stream at ~30 ms/token arrive in 5 bursts with gaps up
to 0.8 s; time alone would POST every few ms on a fast GPU. With both, the gap between yields is at most about
`flush_s` plus one engine step, and the POSTs per job at most about duration / flush_s plus the few early
count-full yields."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class BatchSizer:
    """Tokens per yield: min, min*g, min*g^2, ... capped at max (1, 3, 9, 27, 50, ...). Small early yields
    give a fast first token; later ones bound the POST rate of a fast stream."""

    def __init__(self, min_size: int, growth: float, max_size: int):
        self.size, self.growth, self.max = max(1, min(min_size, max_size)), growth, max_size

    def next(self) -> int:
        cur = self.size
        self.size = min(self.max, max(cur + 1, int(cur * self.growth))) if self.growth > 1 else cur
        return cur


def _new_tokens(out) -> int:
    return sum(len(c.delta_token_ids) for c in out.outputs)


async def paced(outputs: AsyncIterator, sizer: BatchSizer, flush_s: float) -> AsyncIterator[list]:
    """Group one request's engine outputs (RequestOutput, in order) into yields: lists of outputs, the last
    one ending with the finished output. Outputs are pulled as soon as the engine makes them (a pending pull
    stays in flight across flushes, so nothing is lost or reordered); closing this generator closes `outputs`,
    which aborts the request."""
    loop = asyncio.get_running_loop()
    it = aiter(outputs)
    group: list = []
    pending, batch, last = 0, sizer.next(), loop.time()
    pull: asyncio.Future | None = None
    try:
        while True:
            if pull is None:
                pull = asyncio.ensure_future(anext(it))
            wait = None if not pending else max(0.0, last + flush_s - loop.time())
            done, _ = await asyncio.wait({pull}, timeout=wait)
            if done:
                try:
                    out = pull.result()
                except StopAsyncIteration:  # the stream ended without a finished output (aborted)
                    if group:
                        yield group
                    return
                pull = None
                group.append(out)
                if out.finished:
                    yield group
                    return
                pending += _new_tokens(out)
                if pending < batch and (not pending or loop.time() - last < flush_s):
                    continue
            if group:  # count batch full, or flush_s passed with tokens pending
                last = loop.time()
                yield group
                group, pending, batch = [], 0, sizer.next()
    finally:
        if pull is not None and not pull.done():
            pull.cancel()  # raises CancelledError inside `outputs` at its await: it aborts the request
            await asyncio.wait({pull})
        await it.aclose()
