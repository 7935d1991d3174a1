"""handler.pacing: streamed yields go out when their count is full or when the flush interval has passed with a
token pending. The source here is a scripted stand-in for the engine's stream (the real engine runs through the
same function in test_handler_jobs.py), so each test controls exactly when tokens arrive."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from handler.pacing import BatchSizer, paced


@dataclass
class Choice:
    delta_token_ids: list


@dataclass
class Out:
    outputs: list
    finished: bool = False


def tok(finished=False):
    return Out([Choice([1])], finished)


class Source:
    """An async iterator of outputs fed by the test; records whether it was closed (the engine's abort)."""

    def __init__(self):
        self.q: asyncio.Queue = asyncio.Queue()
        self.closed = False

    async def gen(self):
        try:
            while True:
                item = await self.q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.closed = True


def test_batch_sizes_grow_like_worker_vllm():
    s = BatchSizer(1, 3, 50)
    assert [s.next() for _ in range(7)] == [1, 3, 9, 27, 50, 50, 50]


async def collect(agen, timeout=5.0):
    return await asyncio.wait_for(agen.__anext__(), timeout)


def test_count_bound_when_the_flush_interval_is_long():
    async def go():
        src = Source()
        for _ in range(20):
            src.q.put_nowait(tok())
        src.q.put_nowait(tok(finished=True))
        return [len(g) async for g in paced(src.gen(), BatchSizer(1, 3, 50), flush_s=3600)]

    assert asyncio.run(go()) == [1, 3, 9, 8]  # the last group ends with the finished output, however short


def test_a_pending_token_goes_out_after_the_flush_interval_while_the_engine_is_silent():
    async def go():
        src = Source()
        p = paced(src.gen(), BatchSizer(1, 3, 50), flush_s=0.05)
        src.q.put_nowait(tok())
        assert len(await collect(p)) == 1  # the first token at once (batch 1)
        src.q.put_nowait(tok())  # batch is now 3: one pending, then nothing more arrives
        loop = asyncio.get_running_loop()
        t = loop.time()
        group = await collect(p)  # must come from the timer: the source stays silent
        waited = loop.time() - t
        assert len(group) == 1 and 0.04 <= waited < 2.0
        src.q.put_nowait(tok(finished=True))
        assert [o.finished for o in await collect(p)] == [True]
        with pytest.raises(StopAsyncIteration):
            await collect(p)
        assert src.closed

    asyncio.run(go())


def test_no_flush_without_a_pending_token():
    async def go():
        src = Source()
        p = paced(src.gen(), BatchSizer(1, 3, 50), flush_s=0.01)
        src.q.put_nowait(tok())
        await collect(p)
        with pytest.raises(asyncio.TimeoutError):  # nothing pending: no empty yields, however long we wait
            await collect(p, timeout=0.2)

    asyncio.run(go())


def test_a_token_arriving_after_the_interval_goes_out_at_once():
    async def go():
        src = Source()
        p = paced(src.gen(), BatchSizer(1, 3, 50), flush_s=0.05)
        src.q.put_nowait(tok())
        await collect(p)
        await asyncio.sleep(0.1)  # a slow step: the interval has passed before the next token exists
        src.q.put_nowait(tok())
        src.q.put_nowait(tok())
        return len(await collect(p))

    assert asyncio.run(go()) == 1  # flushed on arrival, not held for the count of 3


def test_closing_the_consumer_closes_the_engine_stream_and_errors_pass_through():
    async def go():
        src = Source()
        p = paced(src.gen(), BatchSizer(1, 3, 50), flush_s=10)
        src.q.put_nowait(tok())
        await collect(p)
        task = asyncio.ensure_future(collect(p))  # waiting on the engine when cancelled
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await p.aclose()
        assert src.closed  # the engine stream saw the close (in the engine: abort, blocks freed)

        src2 = Source()
        p2 = paced(src2.gen(), BatchSizer(1, 3, 50), flush_s=10)
        src2.q.put_nowait(RuntimeError("engine fault"))
        with pytest.raises(RuntimeError, match="engine fault"):
            await collect(p2)

    asyncio.run(go())
