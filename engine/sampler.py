"""Batched sampling with per-request params, in vLLM's order:
raw logprobs -> min_tokens mask -> penalties -> greedy argmax | temperature, min_p, top_k, top_p, draw."""

from __future__ import annotations

import torch

from engine.types import Request


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[dict | None]]:
        """logits: [S, vocab] fp32, one row per request. Returns the sampled ids and top-N logprobs."""
        logprobs = self._raw_logprobs(logits, reqs)
        if all(r.params.greedy and not r.params.needs_penalties and r.params.min_tokens == 0 for r in reqs):
            tokens = logits.argmax(dim=-1).tolist()
            return tokens, self._pick_logprobs(logprobs, reqs, tokens)

        logits = logits.clone()
        self._mask_min_tokens(logits, reqs)
        self._apply_penalties(logits, reqs)
        tokens = logits.argmax(dim=-1)  # greedy rows keep these
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            tokens[rand] = self._draw(logits[rand], [reqs[i] for i in rand])
        tokens = tokens.tolist()
        return tokens, self._pick_logprobs(logprobs, reqs, tokens)

    # ---- steps -----------------------------------------------------------------------------
    def _raw_logprobs(self, logits, reqs):
        rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not rows:
            return None
        return rows, torch.log_softmax(logits[rows], dim=-1)

    def _pick_logprobs(self, logprobs, reqs, tokens):
        out: list[dict | None] = [None] * len(reqs)
        if logprobs is None:
            return out
        rows, lp = logprobs
        for j, i in enumerate(rows):
            n = reqs[i].params.logprobs
            top_v, top_i = lp[j].topk(n) if n else (lp[j][:0], lp[j][:0].long())
            d = dict(zip(top_i.tolist(), top_v.tolist()))
            t = tokens[i]
            d.setdefault(t, lp[j, t].item())
            out[i] = d
        return out

    def _mask_min_tokens(self, logits, reqs):
        for i, r in enumerate(reqs):
            if len(r.output_token_ids) < r.params.min_tokens:
                stop = list(r.eos_token_ids if not r.params.ignore_eos else ()) + r.params.stop_token_ids
                if stop:
                    logits[i, stop] = float("-inf")

    def _apply_penalties(self, logits, reqs):
        for i, r in enumerate(reqs):
            p = r.params
            if not p.needs_penalties:
                continue
            row = logits[i]
            out = torch.tensor(r.output_token_ids, dtype=torch.int64, device=self.device)
            counts = torch.bincount(out, minlength=self.vocab_size)[: self.vocab_size].to(row.dtype)
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                seen[torch.tensor(r.prompt_token_ids, dtype=torch.int64, device=self.device)] = True
                penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, penalized, row))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def _draw(self, logits, reqs):
        temp = torch.tensor([r.params.temperature for r in reqs], device=self.device)
        logits = logits / temp[:, None]
        min_p = torch.tensor([r.params.min_p for r in reqs], device=self.device)
        if bool((min_p > 0).any()):
            probs = logits.softmax(-1)
            cutoff = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            logits = logits.masked_fill(probs < cutoff, float("-inf"))
        top_k = [r.params.top_k for r in reqs]
        top_p = torch.tensor([r.params.top_p for r in reqs], device=self.device)
        if any(top_k) or bool((top_p < 1).any()):
            logits = self._top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(-1)
        # Exponential race (as vLLM): argmax(p / q), q ~ Exp(1), equals a draw from p. Seeded rows
        # draw q from their own generator, so their tokens do not depend on the rest of the batch.
        q = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(reqs) if r.generator is None]
        if unseeded:
            q[unseeded] = torch.empty_like(probs[unseeded]).exponential_()
        for i, r in enumerate(reqs):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        return (probs / q).argmax(dim=-1)

    def _top_k_top_p(self, logits, top_k, top_p):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        v = logits.shape[-1]
        k = torch.tensor([min(t, v) if t else v for t in top_k], device=self.device)  # any top_k >= v: all
        pos = torch.arange(v, device=self.device)[None, :]
        drop = pos >= k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
