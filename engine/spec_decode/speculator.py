"""The engine's side of speculative decoding: who speculates how far, the proposals, and the counters.

A step, with speculation on:
1. `before_schedule`: n-gram proposals for every running sequence that is decoding (host only, cheap).
2. The scheduler grants each of them up to `lookahead(req)` extra slots (its k drafts) after every running
   sequence has its real token: a short pool or token budget shortens speculation before anyone is preempted.
3. `propose`: the draft model proposes exactly the granted number for the whole batch at once (its KV lives in
   its own pool under the target's block ids, see draft.py); n-gram drafts are cut to the grant.
4. The runner verifies k + 1 rows per speculating sequence in the same flat batch as prefill chunks and plain
   decodes (rejection.py); the scheduler keeps the accepted run and frees the blocks of rejected slots.
5. `after_update`: per sequence and engine counters (vLLM's spec_decode metrics)."""

from __future__ import annotations

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer
from engine.types import Request, SchedulerOutput


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, draft=None):
        self.cfg = cfg
        self.k = cfg.num_speculative_tokens
        self.max_model_len = max_model_len
        self.draft = draft  # a DraftProposer for method draft_model
        self.ngram = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max) if cfg.method == "ngram" else None
        self._ngram_drafts: dict[Request, list[int]] = {}  # this step's, rebuilt before each schedule
        self.num_drafts = 0  # verification runs (a sequence's step with >= 1 draft)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k

    def budget(self, req: Request) -> int:
        """The most drafts `req` can use now: every emitted token must fit max_tokens and max_model_len."""
        p = req.params
        room = self.max_model_len - req.num_tokens - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - len(req.output_token_ids) - 1)
        return max(0, min(self.k, room))

    def lookahead(self, req: Request) -> int:
        """Slots the scheduler may grant `req` this step (it is decoding: all its real tokens are scheduled)."""
        if self.ngram is not None:
            return len(self._ngram_drafts.get(req, ()))
        return self.budget(req)

    def before_schedule(self, running: list[Request]) -> None:
        if self.ngram is None:
            return
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        ks = [self.budget(r) for r in decoding]
        self._ngram_drafts = dict(zip(decoding, self.ngram.propose(decoding, ks)))

    def propose(self, out: SchedulerOutput) -> None:
        """Fill out.spec_tokens (and out.draft_probs) for the granted lookahead."""
        if not out.spec:
            return
        if self.ngram is not None:
            out.spec_tokens = {r: self._ngram_drafts[r][:s] for r, s in out.spec.items()}
            return
        out.spec_tokens, out.draft_probs = self.draft.propose(list(out.spec), list(out.spec.values()))

    def after_update(self, out: SchedulerOutput, sampled: dict[Request, list[int]]) -> None:
        for req, s in out.spec.items():
            tokens = sampled.get(req)
            if tokens is None:
                continue
            a = len(tokens) - 1  # accepted drafts (the last token is the target's own)
            self.num_drafts += 1
            self.num_draft_tokens += s
            self.num_accepted_tokens += a
            req.spec_draft_tokens += s
            req.spec_verify_steps += 1
            req.spec_accepted_tokens += a
            if len(req.spec_accepted_per_pos) < self.k:
                req.spec_accepted_per_pos = [0] * self.k
            for j in range(a):
                self.accepted_per_pos[j] += 1
                req.spec_accepted_per_pos[j] += 1
            if self.draft is not None:
                self.draft.verified(req, s, a)

    def stats(self) -> dict:
        n, d, a = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {
            "spec_decode_num_drafts": n,
            "spec_decode_num_draft_tokens": d,
            "spec_decode_num_accepted_tokens": a,
            "spec_decode_acceptance_rate": a / d if d else 0.0,
            "spec_decode_mean_acceptance_length": 1 + a / n if n else 0.0,
            "spec_decode_accepted_per_pos": [x / n if n else 0.0 for x in self.accepted_per_pos],
        }
