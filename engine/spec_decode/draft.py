"""A draft model: a small model of the target's vocabulary proposes k tokens autoregressively for the whole batch
at once (one forward over every sequence's catch-up tokens, then k - 1 one-token steps).

Its KV pool has the target's block count and block size, and the draft writes each sequence's KV under the
target's own block ids: it needs no block manager, its lookahead slots are the ones the scheduler granted the
target, and rolling back rejected slots is the target's rollback. A block the draft has filled is marked in
the block manager (`draft_ready`, cleared when the block is handed out for new data), so a prefix-cache hit is
skipped by the draft as well.

Greedy sequences get the draft's argmax (q one-hot). Random ones draw from the draft's softmax at the sequence's
temperature, with its generator when seeded, and hand q to verification. The draft runs without the sequence's
LoRA adapter, in the target's dtype, with a KV cache in that dtype, eagerly."""

from __future__ import annotations

import logging
import weakref

import torch

import kernels
from engine.errors import ConfigError
from engine.kv_cache import allocate
from engine.layers.attention import build_attention
from engine.model_runner import ModelRunner
from engine.models import model_class
from engine.models.spec import ModelSpec
from engine.sampler import Sampler
from engine.types import Request
from engine.weights import iter_weights

log = logging.getLogger("engine")


class DraftProposer:
    def __init__(self, engine, path, spec: ModelSpec):
        """`engine`: the target LLMEngine, built up to its block manager; path and spec: the draft checkpoint's."""
        cfg = engine.cfg
        self.path, self.spec = path, spec
        check_vocab(engine, spec, path)
        self.block_size = cfg.block_size
        self.max_tokens = cfg.max_num_batched_tokens  # the most tokens one draft forward takes
        self.bm = engine.block_manager
        self.device = engine.device
        m = model_class(self.spec)(self.spec, engine.dtype, engine.device, engine.max_model_len, None)
        m.load_weights(iter_weights(self.path, engine.device))
        s = self.spec
        kv = allocate(s, engine.memory, engine.dtype, engine.device)  # the target's block count and size
        attn = build_attention(s, cfg.block_size, engine.kernel_backend)
        self.runner = ModelRunner(
            m, kv, attn, cfg.block_size, engine.device, engine.kernel_backend, None,
            max_num_seqs=cfg.max_num_seqs, max_model_len=engine.max_model_len,
        )  # fmt: skip
        self.kv_bytes = kv.numel() * kv.element_size()
        # per sequence: (tokens whose draft KV is valid, the preemption count it was computed under)
        self._computed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.num_catchup_tokens = 0  # tokens of the sequences themselves the draft has run (not its own drafts)
        log.info("draft model %s (%s): %d layers, KV %.0f MiB", self.path, s.architecture, s.num_layers,
                 self.kv_bytes / 2**20)  # fmt: skip

    def _start(self, req: Request) -> int:
        """The first position whose draft KV is missing: where its own last run left it, else past the leading
        blocks some earlier draft run filled (prefix-cache hits)."""
        n, pre = self._computed.get(req, (0, -1))
        if pre == req.num_preemptions:
            return n
        bs, ready, full = self.block_size, 0, (req.num_tokens - 1) // self.block_size
        while ready < min(full, len(req.block_ids)) and self.bm.draft_ready[req.block_ids[ready]]:
            ready += 1
        return ready * bs

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int]) -> tuple[dict, dict]:
        """ks[i] (>= 1) drafts for reqs[i]. Returns {req: drafts} and {req: q rows [k, vocab]} for sampled drafts."""
        starts = [self._start(r) for r in reqs]
        drafts: dict[Request, list[int]] = {r: [] for r in reqs}
        probs: dict[Request, list[torch.Tensor]] = {r: [] for r in reqs if not r.params.greedy}
        items = []
        for step in range(max(ks)):
            if step == 0:  # the tokens the draft has not seen yet, in forwards of at most the step budget
                active, logits = list(reqs), self._catch_up(reqs, starts)
            else:
                hidden, qsl = self.runner.forward(items)
                active = [r for r, _, _ in items]
                logits = self._last_logits(hidden, qsl)
            for r, t in zip(active, self._pick(logits, active, probs)):
                drafts[r].append(t)
            if step == 0:
                for r, s in zip(reqs, starts):
                    self._computed[r] = (r.num_tokens, r.num_preemptions)
                    self._mark_ready(r, s)
            items = [(r, r.num_tokens + step, [drafts[r][-1]]) for r, k in zip(reqs, ks) if k > step + 1]
        return drafts, {r: torch.stack(q) for r, q in probs.items()}

    def _catch_up(self, reqs: list[Request], starts: list[int]) -> torch.Tensor:
        """Run the draft over each sequence's unseen tokens (a whole prompt after a prefill), in forwards of at most
        max_num_batched_tokens tokens (a long prompt in several chunks, in order): the logits of each sequence's
        last token, [B, vocab]."""
        pending = [(r, s, r.token_slice(s, r.num_tokens)) for r, s in zip(reqs, starts)]
        self.num_catchup_tokens += sum(len(t) for _, _, t in pending)
        last: dict[Request, torch.Tensor] = {}
        while pending:
            batch, room, rest = [], self.max_tokens, []
            for r, s, toks in pending:
                take = min(len(toks), room) if room > 0 else 0
                if take:
                    batch.append((r, s, toks[:take]))
                    room -= take
                if take < len(toks):
                    rest.append((r, s + take, toks[take:]))
            hidden, qsl = self.runner.forward(batch)
            for (r, _, _), row in zip(batch, self._last_logits(hidden, qsl)):
                last[r] = row
            pending = rest
        return torch.stack([last[r] for r in reqs])

    def _last_logits(self, hidden: torch.Tensor, qsl: list[int]) -> torch.Tensor:
        rows = torch.tensor([e - 1 for e in qsl[1:]], device=self.device)
        with kernels.backend(self.runner.kernel_backend):
            return self.runner.model.compute_logits(hidden[rows])  # [B, vocab] fp32

    def _pick(self, logits: torch.Tensor, reqs: list[Request], probs: dict) -> list[int]:
        tokens = logits.argmax(dim=-1)
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            t = torch.tensor([[reqs[i].params.temperature] for i in rand], device=logits.device)
            q = (logits[rand] / t).softmax(-1)
            tokens[rand] = Sampler.race(q, [reqs[i] for i in rand])
            for j, i in enumerate(rand):
                probs[reqs[i]].append(q[j])
        return tokens.tolist()

    def _mark_ready(self, req: Request, start: int) -> None:
        for b in range(start // self.block_size, req.num_tokens // self.block_size):
            self.bm.draft_ready[req.block_ids[b]] = 1

    def verified(self, req: Request, granted: int, accepted: int) -> None:
        """After verification: the KV of accepted drafts is valid (the draft wrote drafts 1..granted-1)."""
        n, pre = self._computed.get(req, (0, -1))
        self._computed[req] = (n + min(accepted, granted - 1), pre)


def check_vocab(engine, spec: ModelSpec, path) -> None:
    """The draft proposes token ids the target verifies: both must mean the same tokens."""
    if spec.vocab_size != engine.spec.vocab_size:
        raise ConfigError(
            f"speculative_config.model={str(path)!r}: the draft's vocabulary has {spec.vocab_size} tokens, the "
            f"target's {engine.spec.vocab_size}; a draft model must share the target's tokenizer"
        )
    tok = path / "tokenizer.json"
    if tok.exists():
        from engine.tokenizer import Tokenizer

        theirs = Tokenizer(path).backend
        ours = engine.tok.backend
        if theirs is not None and ours is not None and theirs.get_vocab() != ours.get_vocab():
            raise ConfigError(
                f"speculative_config.model={str(path)!r}: the draft's tokenizer maps tokens to different ids than "
                "the target's; a draft model must share the target's tokenizer"
            )
