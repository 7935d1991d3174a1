"""Token-budget scheduler: chunked prefill mixed with decodes, prefix-cache hits at admission, recompute
preemption. Pure Python."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from engine.block_manager import BlockManager
from engine.state_slots import StateSlots
from engine.types import Request, RequestStatus, SchedulerOutput

log = logging.getLogger("engine")
OOM_RECOVERY_S = 30.0  # after a step ran out of memory, its halved limits double back once per this many quiet seconds


class Admission(Protocol):
    """A gate on waiting requests (LoRAManager: a request starts once its adapter sits in a device slot)."""

    def can_start(self, req: Request, running: list[Request]) -> bool:
        """Whether `req` could start now, changing nothing. `running`: the running requests."""

    def admit(self, req: Request, running: list[Request]) -> None:
        """`req` starts: take what can_start found for it."""

    def refused(self, waiting) -> dict[Request, BaseException]:
        """Waiting requests that can never start (their adapter failed to load, or not in time), with why."""


class Scheduler:
    """Each step spends at most `max_num_batched_tokens` tokens over at most `max_num_seqs` requests.

    Running requests go first (one token per decode, the next chunk for an unfinished prefill); waiting
    requests fill what is left, a chunk at a time. When blocks run out, the most recently admitted running
    request is preempted by recompute: its blocks are freed and it goes back to the front of the queue.

    With speculative decoding (`lookahead`: how many drafts a decoding request would verify), each decoding
    request then gets up to that many extra slots from what is left of the budget and the pool, after every
    running request has its real tokens: a short pool shortens speculation and never preempts for it.
    Waiting requests are admitted after that.

    The scheduler also applies the stop rules when it appends sampled tokens (`update`), a grammar's end among
    them."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int = 0,
        admission: Admission | None = None,
        lookahead: Callable[[Request], int] | None = None,
        state_slots: StateSlots | None = None,
    ):
        """state_slots: a hybrid model's (one per running request, taken at admission, given back when it stops
        running)."""
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # vLLM's knob: no request takes more than this many tokens in one step (0 = only the budget limits).
        # A long prompt then arrives in small chunks, so the decodes sharing its steps stay smooth.
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # A request the gate cannot start yet stays queued without blocking the others
        self.admission = admission
        self.lookahead = lookahead  # speculative decoding: the drafts a decoding request would verify
        self.state_slots = state_slots
        # After a step ran out of device memory (halve()): at most this many tokens and running requests per step,
        # doubling back every OOM_RECOVERY_S without another (None: the configured limits)
        self.oom_limits: tuple[int, int] | None = None
        self.oom_at = 0.0

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(requests=[], num_scheduled_tokens=[])
        if self.admission is not None:
            for req, err in self.admission.refused(self.waiting).items():
                self.finish(req, "abort")
                out.failed[req] = err
        budget = self._schedule_running(out, self._limits()[0])
        if self.lookahead is not None:
            budget = self._grant_lookahead(out, budget)
        # Admit waiting requests only when nothing was preempted this step: otherwise the
        # freed blocks would be handed straight to a newcomer and the victim would starve.
        if not out.preempted:
            self._admit_waiting(out, budget)
        out.sampling = [
            r
            for r, n in zip(out.requests, out.num_scheduled_tokens)
            if r.num_computed_tokens + n - out.spec.get(r, 0) == r.num_tokens and r.params.pooling is None
        ]
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests first, in admission order; out of blocks, the most recently admitted is preempted.
        Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.chunk_cap)
            while not self.bm.allocate_slots(req, n):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.PREEMPTED:
                break
            out.requests.append(req)
            out.num_scheduled_tokens.append(n)
            budget -= n
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Waiting requests in order while the budget, max_num_seqs and the pool allow, each from its first
        uncached token."""
        held = []  # waiting requests that cannot start yet (their adapter is loading): they keep their place
        max_seqs = self._limits()[1]
        while self.waiting and budget > 0 and len(self.running) < max_seqs:
            req = self.waiting[0]
            if self.admission is not None and not self.admission.can_start(req, self.running):
                held.append(self.waiting.popleft())
                continue
            hits = self.bm.find_cached(req)  # a cached prefix counts as computed
            num_cached = len(hits) * self.bm.block_size
            n = min(req.num_tokens - num_cached, budget, self.chunk_cap)  # from the first uncached token
            if not self.bm.allocate_slots(req, n, hits):
                break
            if self.admission is not None:
                self.admission.admit(req, self.running)
            req.num_computed_tokens = num_cached
            if req.cache_key:
                self.bm.record_lookup(req.num_tokens, num_cached)
            if req.num_cached_tokens is None:
                req.num_cached_tokens = min(num_cached, req.num_prompt_tokens)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.waiting.popleft()
            if self.state_slots is not None:
                self.state_slots.take(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_scheduled_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(held))

    def _grant_lookahead(self, out: SchedulerOutput, budget: int) -> int:
        for j, (req, n) in enumerate(zip(out.requests, out.num_scheduled_tokens)):
            if budget <= 0:
                break
            if n != 1 or req.num_computed_tokens != req.num_tokens - 1 or req.params.pooling is not None:
                continue  # only a decode speculates (an embedding's one-token last chunk is not one)
            k = min(self.lookahead(req), budget)
            while k and not self.bm.allocate_slots(req, n, num_lookahead=k):
                k -= 1  # the pool is short: fewer drafts
            if k:
                out.spec[req] = k
                out.num_scheduled_tokens[j] += k
                budget -= k
        return budget

    def _limits(self) -> tuple[int, int]:
        """This step's token budget and running-request cap: the configured ones, or less after running out of
        memory (halve())."""
        if self.oom_limits is None:
            return self.max_num_batched_tokens, self.max_num_seqs
        if time.monotonic() - self.oom_at >= OOM_RECOVERY_S:
            tokens, seqs = (2 * v for v in self.oom_limits)
            self.oom_at = time.monotonic()
            if tokens >= self.max_num_batched_tokens and seqs >= self.max_num_seqs:
                self.oom_limits = None
                log.info("the step limits are back to %d tokens and %d requests", tokens, seqs)
                return self.max_num_batched_tokens, self.max_num_seqs
            self.oom_limits = (min(tokens, self.max_num_batched_tokens), min(seqs, self.max_num_seqs))
        return self.oom_limits

    def halve(self, out: SchedulerOutput, preempt: bool = True) -> None:
        """`out` ran out of memory and computed nothing: roll it back (engine/block_manager.py roll_back), preempt the
        most recently admitted half of its requests by recompute (those admitted this step first: they return to
        the front of the queue), and halve the step's token budget and running cap until OOM_RECOVERY_S pass without
        another. preempt=False: the limits only (the retry of a step that was halved already)."""
        for req in out.requests:
            self.bm.roll_back(req)
        stepped = set(out.requests)
        ran = [r for r in self.running if r in stepped]  # admission order
        # a hybrid model's state slots may hold some layers' update of the failed step: every request of it
        # recomputes from its prompt
        victims = ran if self.state_slots is not None else ran[(len(ran) + 1) // 2 :] if preempt else ()
        for req in reversed(victims):
            self.running.remove(req)
            self._preempt(req)
        tokens, seqs = self._limits()
        kept = len(self.running) + ((len(ran) + 1) // 2 if self.state_slots is not None else 0)  # as if halved
        self.oom_limits = (max(1, min(tokens, out.total_tokens) // 2), max(1, min(seqs, kept)))
        self.oom_at = time.monotonic()
        log.warning("out of memory: steps now take at most %d tokens and %d requests", *self.oom_limits)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[Request, list[int]]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests that hit a stop rule.

        `sampled` maps the requests that produced tokens this step to them: one, or with speculation the
        accepted drafts and the target's own token. Tokens after a stop are dropped, and the slots of rejected
        drafts are rolled back (their blocks freed). Returns the newly finished."""
        finished = []
        for req, n in zip(out.requests, out.num_scheduled_tokens):
            tokens = sampled.get(req)
            granted = out.spec.get(req, 0)
            # the KV of accepted drafts is valid; that of rejected ones is not
            req.num_computed_tokens += n - granted + (len(tokens) - 1 if tokens and granted else 0)
            if req.params.pooling is not None and req.num_computed_tokens >= req.num_prompt_tokens:
                self.finish(req, "stop")  # an embedding: its prompt is computed and pooled (engine/pooling.py)
                finished.append(req)
                continue
            for token in tokens or ():
                req.output_token_ids.append(token)
                if req.matcher is not None:
                    _advance_grammar(req, token)
                reason = self._check_stop(req, token)
                if reason is not None:
                    self.finish(req, reason)
                    finished.append(req)
                    break
            if granted and not req.finished:
                self.bm.trim(req, req.num_computed_tokens)
        return finished

    def _check_stop(self, req: Request, token: int) -> str | None:
        p = req.params
        num_out = len(req.output_token_ids)
        if num_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                req.stop_reason = token
                return "stop"
        if req.grammar_stop_at is not None and num_out >= req.grammar_stop_at:  # the grammar ended here
            return "stop"
        if p.max_tokens is not None and num_out >= p.max_tokens:
            return "length"
        if req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, req: Request, reason: str) -> None:
        """Remove `req` wherever it is and free its blocks. Safe to call twice."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def _release(self, req: Request) -> None:
        """Its blocks, and a hybrid's state slot, back to their pools."""
        self.bm.free(req)
        if self.state_slots is not None:
            self.state_slots.give_back(req)


def _advance_grammar(req: Request, token: int) -> None:
    """A constrained sequence's matcher accepts its new token. The mask allowed it, unless another rule removed
    every allowed token (min_tokens masks the stop token a complete grammar leaves): then the sequence stops at
    that token, rather than the step failing everyone. Where the grammar ends is recorded as an output length
    (`grammar_stop_at`), which _check_stop applies, so a run of accepted drafts stops exactly there."""
    if req.grammar_stop_at is not None:
        return
    if (after := req.grammar_after) is not None:  # not started: it starts after the output has written `after`
        if tuple(req.output_token_ids[-len(after) :]) == after:
            req.grammar_after = None
        return
    ok = req.matcher.accept_token(token)
    if not ok:
        log.warning("%s: the grammar allows no token here; the sequence stops", req.request_id)
    if not ok or req.matcher.is_terminated():
        req.grammar_stop_at = len(req.output_token_ids)
