"""The engine's side of speculative decoding: who speculates how far, and the proposals.

A step, with speculation on:
1. The scheduler grants each decoding sequence up to `lookahead(req)` extra slots (its k drafts) after every
   running sequence has its real token: a short pool or token budget shortens speculation before anyone is
   preempted. With n-gram proposals, `lookahead` is the length of the proposal (host only, cheap), made then.
2. `propose`: the drafts for exactly the granted slots, as values: the draft model runs over every speculating
   sequence at once (its KV lives in its own pool under the target's block ids, see draft.py); n-gram proposals
   are cut to the grant.
3. The step runner verifies k + 1 rows per speculating sequence in the same flat batch as prefill chunks and plain
   decodes (rejection.py); the scheduler keeps the accepted run and frees the blocks of rejected slots; the output
   processor counts what was accepted (vLLM's spec_decode metrics)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kv_cache import Prefaulter
from engine.memory import MemoryPlan
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft import DraftProposer
from engine.spec_decode.ngram import NgramProposer
from engine.startup import ModelFacts
from engine.timeline import Timeline
from engine.tokenizer import Tokenizer
from engine.types import Request, SchedulerOutput

log = logging.getLogger("engine")


@dataclass(frozen=True)
class Drafts:
    """One step's proposals."""

    tokens: dict[Request, list[int]] = field(default_factory=dict)  # per speculating request: its granted drafts
    probs: dict[Request, Any] = field(default_factory=dict)  # drafts sampled from a draft model: q rows [k, vocab]


NO_DRAFTS = Drafts()


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, draft=None):
        """draft: a DraftProposer for method draft_model; None for n-gram proposals."""
        self.cfg = cfg
        self.k = cfg.num_speculative_tokens
        self.max_model_len = max_model_len
        self.draft = draft
        self.ngram = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max) if cfg.method == "ngram" else None
        self._ngram_drafts: dict[Request, list[int]] = {}  # this step's proposals, made as the scheduler asks

    def budget(self, req: Request) -> int:
        """The most drafts `req` can use now: every emitted token must fit max_tokens and max_model_len."""
        p = req.params
        room = self.max_model_len - req.num_tokens - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - len(req.output_token_ids) - 1)
        return max(0, min(self.k, room))

    def lookahead(self, req: Request) -> int:
        """Slots the scheduler may grant `req` this step (it is decoding: all its real tokens are scheduled)."""
        if self.ngram is None:
            return self.budget(req)
        self._ngram_drafts[req] = drafts = self.ngram.propose([req], [self.budget(req)])[0]
        return len(drafts)

    def propose(self, out: SchedulerOutput) -> Drafts:
        """The drafts that fill the lookahead slots granted in `out` (out.spec)."""
        ngram, self._ngram_drafts = self._ngram_drafts, {}
        if not out.spec:
            return NO_DRAFTS
        if self.ngram is not None:
            return Drafts({r: ngram[r][:s] for r, s in out.spec.items()})
        return Drafts(*self.draft.propose(list(out.spec), list(out.spec.values())))


class NoSpeculation:
    """Speculative decoding off: no lookahead slots, no drafts."""

    k = 0
    lookahead = None  # the scheduler grants nothing
    draft = None

    @staticmethod
    def propose(out: SchedulerOutput) -> Drafts:
        return NO_DRAFTS


def start_speculation(
    cfg: EngineConfig,
    facts: ModelFacts,
    plan: MemoryPlan,
    bm: BlockManager,
    tok: Tokenizer,
    timeline: Timeline,
    prefault: Prefaulter | None = None,
) -> Speculator | NoSpeculation:
    """The engine's speculation, as configured: the draft model loaded (its KV pool under the target's block ids,
    so `plan` and `bm` are the target's, and on CPU faulted in with the target's by `prefault`), or n-gram
    proposals, or none."""
    sc = cfg.speculative_config
    if sc is None:
        return NoSpeculation()
    draft = None
    if sc.method == "draft_model":
        draft = DraftProposer(cfg, facts, plan, bm, tok, prefault)
        timeline.mark("draft model", str(draft.path))
    log.info("speculative decoding: %s", sc.describe())
    return Speculator(sc, plan.max_model_len, draft)
