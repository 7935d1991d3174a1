"""Admission control for the load-balancing server, which has no queue in front of it: at most `running` requests
run, at most `waiting` more wait for a slot, in arrival order, for at most `max_wait_s`; anything past that is
turned away at once, so that Runpod's load balancer (or the client) sends it elsewhere.

    ticket = admission.enter()     # Overloaded at once when every slot and every wait place is taken
    await ticket.wait()            # WaitedTooLong after max_wait_s; returns at once when a slot was free
    ...                            # the request runs
    ticket.leave()                 # its slot goes to the longest waiter (idempotent; also for a ticket that never ran)
    admission.close(why)           # shutting down: every waiter's wait() raises Closed now, and enter() too
"""

from __future__ import annotations

import asyncio
import collections
import math


class Overloaded(Exception):
    """Every slot and every wait place is taken: HTTP 429 with Retry-After."""

    def __init__(self, running: int, waiting: int, retry_after_s: int):
        self.retry_after_s = retry_after_s
        super().__init__(
            f"this worker is at its limit: {running} requests running (MAX_CONCURRENCY) and {waiting} waiting "
            f"(LB_MAX_WAITING); retry in {retry_after_s} s or on another worker"
        )


class WaitedTooLong(Exception):
    """A request waited max_wait_s for a slot without getting one: HTTP 503."""


class Closed(Exception):
    """The worker is shutting down: HTTP 503 at once, for a request waiting and for a new one."""


class Ticket:
    def __init__(self, admission: Admission, fut: asyncio.Future):
        self._admission, self._fut, self._left = admission, fut, False
        self.taken = False  # a job took it over: the job leaves it when it ends

    async def wait(self) -> None:
        adm = self._admission
        if self._fut.done():
            return self._fut.result()  # Closed, if the worker closed before it got a slot
        try:
            await asyncio.wait_for(asyncio.shield(self._fut), adm.max_wait_s)
        except asyncio.TimeoutError:
            self.leave()
            adm.refused["waited_too_long"] += 1
            raise WaitedTooLong(
                f"this request waited {adm.max_wait_s:g} s (LB_MAX_WAIT_S) for one of this worker's "
                f"{adm.running} slots (MAX_CONCURRENCY) without getting one; send it again"
            ) from None
        except asyncio.CancelledError:  # the client left while waiting
            self.leave()
            raise

    def leave(self) -> None:
        if not self._left:
            self._left = True
            self._admission._release(self._fut)


class Admission:
    def __init__(self, running: int, waiting: int, max_wait_s: float):
        self.running, self.waiting, self.max_wait_s = running, waiting, max_wait_s
        self.active = 0  # slots held
        self._queue: collections.deque[asyncio.Future] = collections.deque()
        self.mean_run_s = 1.0  # a running estimate of a request's time, for Retry-After
        self.closed: str | None = None  # why (close())
        self.refused: collections.Counter[str] = collections.Counter()  # why: overloaded, waited_too_long, closed, ...

    @property
    def queued(self) -> int:
        return len(self._queue)  # only waiters: one granted a slot or giving up leaves it

    def enter(self) -> Ticket:
        if self.closed is not None:
            self.refused["closed"] += 1
            raise Closed(self.closed)
        fut = asyncio.get_running_loop().create_future()
        if self.active < self.running and not self._queue:
            self.active += 1
            fut.set_result(None)
        elif self.queued < self.waiting:
            self._queue.append(fut)
        else:
            self.refused["overloaded"] += 1
            raise Overloaded(self.active, self.queued, self.retry_after())
        return Ticket(self, fut)

    def close(self, why: str) -> None:
        """No request gets a slot any more: each waiter is turned away now (Closed(why)), and so is every later
        enter(). The running ones keep theirs until they leave."""
        self.closed = why
        while self._queue:
            self.refused["closed"] += 1
            self._queue.popleft().set_exception(Closed(why))

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: a request's mean time, at least 1 s (HTTP's Retry-After is whole)."""
        return max(1, math.ceil(self.mean_run_s))

    def observe(self, seconds: float) -> None:
        """A request's run time, for Retry-After (an exponential mean)."""
        self.mean_run_s += 0.1 * (seconds - self.mean_run_s)

    def _release(self, fut: asyncio.Future) -> None:
        if not fut.done():  # it was waiting: it gives up its place, and never held a slot
            fut.cancel()
            self._queue.remove(fut)
            return
        if fut.cancelled() or fut.exception() is not None:  # it never held a slot (close())
            return
        self.active -= 1
        if self._queue:  # the slot goes to the longest waiter
            self.active += 1
            self._queue.popleft().set_result(None)
