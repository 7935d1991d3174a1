"""Batched sampling with per-request params, in vLLM's order (vllm/v1/sample/sampler.py: the non-argmax-invariant
logits processors MinTokens then LogitBias, then penalties):
raw logprobs -> min_tokens mask -> logit_bias -> penalties -> greedy argmax | temperature, min_p, top_k, top_p, draw.
Logprobs come from the raw logits (vLLM's default raw_logprobs mode): a bias changes what is sampled, not them."""

from __future__ import annotations

import torch

from engine.block_table import h2d
from engine.types import Request


class Rows:
    """A subset of a batch's rows (increasing indices), read with one index_select and written with one index_copy_
    whose index went to the device once through pinned memory, or not indexed at all when it is every row (the
    common case: every request samples randomly). Indexing a CUDA tensor with a Python list instead builds the
    index on the host and copies it with a stream sync, on every read and every write."""

    def __init__(self, rows: list[int], n: int, device: torch.device):
        self.rows, self.every, self.device = rows, len(rows) == n, device
        self._index: torch.Tensor | None = None

    @classmethod
    def where(cls, flags, device: torch.device) -> Rows:
        flags = list(flags)
        return cls([i for i, f in enumerate(flags) if f], len(flags), device)

    def __bool__(self) -> bool:
        return bool(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def index(self) -> torch.Tensor:
        if self._index is None:
            self._index = h2d(self.rows, torch.int64, self.device)
        return self._index

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """These rows of t: t itself when they are all of them (callers do not write into it)."""
        return t if self.every else t.index_select(0, self.index)

    def put(self, t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write `values` (one per row here) into these rows of t, in place; returns t."""
        return t.copy_(values) if self.every else t.index_copy_(0, self.index, values)


CHUNK = 128  # argmax_rows' chunk of a row


def argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch.argmax(logits, -1), logits.amax(-1)) for logits [S, V], the first index of a row's max as argmax gives
    it, on every row whose max is finite (rows with a NaN or an inf are bad_rows, whose token is -1 either way).

    Why: on CPU torch's argmax is not vectorized: 4.6-10 ms for [64, 49152] fp32 on 2 threads of a Xeon, against
    0.45-2.3 ms for amax. So: the max of each 128-wide chunk (one amax pass), the first chunk holding the row's max
    (argmax over [S, V / 128]), and the first max within that chunk. A GPU keeps torch's argmax (one kernel)."""
    s, v = logits.shape
    n = v // CHUNK
    if logits.device.type != "cpu" or n < 2 or not logits.is_contiguous():
        return logits.argmax(dim=-1), logits.amax(dim=-1)
    chunk_max = logits[:, : n * CHUNK].view(s, n, CHUNK).amax(dim=-1)  # [S, n]
    if v % CHUNK:  # the tail: one more chunk, shorter
        chunk_max = torch.cat([chunk_max, logits[:, n * CHUNK :].amax(dim=-1, keepdim=True)], dim=1)
    top, best = chunk_max.max(dim=-1)  # [S]: the first chunk holding the row's max
    start = best * CHUNK
    cols = (start[:, None] + torch.arange(CHUNK)).clamp_max_(v - 1)  # the tail's: its last column repeated after it
    return start + logits.gather(1, cols).argmax(dim=-1), top


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[dict | None]]:
        """logits: [S, vocab] fp32, one row per request. Returns the sampled ids and top-N logprobs."""
        logprobs = self._raw_logprobs(logits, reqs)
        if all(
            r.params.greedy and not r.params.needs_penalties and r.params.min_tokens == 0 and not r.params.logit_bias
            for r in reqs
        ):
            tokens, top = argmax_rows(logits)
            tokens = tokens.masked_fill_(self.bad_rows(logits, top), -1).tolist()
            return tokens, self._pick_logprobs(logprobs, reqs, tokens)

        logits, bad = self.screen(logits)
        self._mask_min_tokens(logits, reqs)
        self._apply_logit_bias(logits, reqs)
        self._apply_penalties(logits, reqs)
        tokens = argmax_rows(logits)[0]  # greedy rows keep these
        rand = Rows.where((not r.params.greedy for r in reqs), self.device)
        if rand:
            rand.put(tokens, self._draw(rand.take(logits), [reqs[i] for i in rand.rows]))
        tokens = tokens.masked_fill_(bad, -1).tolist()
        return tokens, self._pick_logprobs(logprobs, reqs, tokens)

    @staticmethod
    def bad_rows(logits: torch.Tensor, row_max: torch.Tensor | None = None) -> torch.Tensor:
        """[S] bool: rows with a NaN or +inf anywhere, or nothing left to pick (all -inf). A row's max is NaN if
        any element is (torch propagates it), +inf if any is: one reduction, no host sync (none when the caller
        has the rows' max already: `row_max`)."""
        return ~torch.isfinite(logits.amax(dim=-1) if row_max is None else row_max)

    def screen(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of `logits` that sampling may change, its bad rows (bad_rows) zeroed so that no draw fails on them,
        and those rows: the caller samples -1 there, and the step fails their requests (engine/step_runner.py)."""
        bad = self.bad_rows(logits)
        return logits.masked_fill(bad[:, None], 0.0), bad

    # ---- steps -----------------------------------------------------------------------------
    def _raw_logprobs(self, logits, reqs):
        rows = Rows.where((r.params.logprobs is not None for r in reqs), self.device)
        if not rows:
            return None
        return rows.rows, torch.log_softmax(rows.take(logits), dim=-1)

    def _pick_logprobs(self, logprobs, reqs, tokens):
        """Top-n and the sampled token's logprob for each row that asked: one batched topk and gather, one copy
        to the host (not a topk, two .tolist() and an .item() per request, each a device sync)."""
        out: list[dict | None] = [None] * len(reqs)
        if logprobs is None:
            return out
        rows, lp = logprobs
        n_max = max(reqs[i].params.logprobs for i in rows)
        top_v, top_i = lp.topk(n_max, dim=-1) if n_max else (lp[:, :0], lp[:, :0])
        sampled = lp.gather(1, h2d([[max(tokens[i], 0)] for i in rows], torch.int64, lp.device))  # -1: a bad row
        # values, then the sampled token's, then the ids (exact in fp32: vocabularies are far below 2**24)
        host = torch.cat([top_v, sampled, top_i.to(lp.dtype)], 1).cpu().tolist()
        for j, i in enumerate(rows):
            n, row = reqs[i].params.logprobs, host[j]
            d = dict(zip(map(int, row[n_max + 1 : n_max + 1 + n]), row[:n]))
            d.setdefault(tokens[i], row[n_max])
            out[i] = d
        return out

    def _mask_min_tokens(self, logits, reqs):
        """Every (row, stop id) pair of the rows below their min_tokens in one copy and one indexed write (not a
        list-indexed write per row, each a blocking copy)."""
        rows, ids = [], []
        for i, r in enumerate(reqs):
            if len(r.output_token_ids) < r.params.min_tokens:
                stop = list(r.eos_token_ids if not r.params.ignore_eos else ()) + r.params.stop_token_ids
                rows += [i] * len(stop)
                ids += stop
        if rows:
            at = h2d([rows, ids], torch.int64, self.device)  # [2, N]
            logits[at[0], at[1]] = float("-inf")

    def _apply_logit_bias(self, logits, reqs):
        """Every biased row at once: (row, token id) pairs and their biases go to the device as two flat tensors
        (non-blocking copies) and one scatter-add adds them; rows without a bias are not touched. After the
        min_tokens mask, as in vLLM: -inf + bias stays -inf, so a bias never lifts a masked (or grammar-banned)
        token."""
        rows, ids, vals = [], [], []
        for i, r in enumerate(reqs):
            if b := r.params.logit_bias:
                rows += [i] * len(b)
                ids += b.keys()
                vals += b.values()
        if rows:
            at = h2d([rows, ids], torch.int64, self.device)  # [2, N]
            logits.index_put_((at[0], at[1]), h2d(vals, logits.dtype, self.device), accumulate=True)

    def _apply_penalties(self, logits, reqs):
        """All penalized rows at once: their output (and, for the repetition penalty, prompt) tokens go to the
        device in one padded tensor each, and the counts come from one scatter_add (not two copies, each a
        sync, and a full-vocab bincount per request)."""
        rows = Rows.where((r.params.needs_penalties for r in reqs), self.device)
        if not rows:
            return
        ps = [reqs[i].params for i in rows.rows]
        sub = rows.take(logits)
        counts = self._counts([reqs[i].output_token_ids for i in rows.rows], sub.dtype)
        if any(p.repetition_penalty != 1.0 for p in ps):
            seen = (counts + self._counts([reqs[i].prompt_token_ids for i in rows.rows], sub.dtype)) > 0
            rep = self._column([p.repetition_penalty for p in ps])
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq, pres = self._column([p.frequency_penalty for p in ps]), self._column([p.presence_penalty for p in ps])
        rows.put(logits, sub - freq * counts - pres * (counts > 0).to(sub.dtype))

    def _counts(self, seqs: list[list[int]], dtype) -> torch.Tensor:
        """[len(seqs), vocab] occurrence counts; padding with id `vocab` lands in a dropped extra column."""
        width = max(1, max(len(t) for t in seqs))
        ids = h2d([t + [self.vocab_size] * (width - len(t)) for t in seqs], torch.int64, self.device)
        counts = torch.zeros(len(seqs), self.vocab_size + 1, dtype=dtype, device=self.device)
        return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=dtype))[:, : self.vocab_size]

    def _column(self, values: list[float]) -> torch.Tensor:
        """[n, 1] fp32 on the device, copied without waiting for the stream (pinned staging)."""
        return h2d([[v] for v in values], torch.float32, self.device)

    def _draw(self, logits, reqs):
        return self.race(self.probs(logits, reqs), reqs)

    def probs(self, logits, reqs) -> torch.Tensor:
        """The distribution a random row draws from: temperature, min_p, top_k, top_p, softmax. [R, vocab]."""
        # Which options apply is known on the host: no device round trip to find out
        logits = logits / self._column([r.params.temperature for r in reqs])
        if any(r.params.min_p > 0 for r in reqs):
            probs = logits.softmax(-1)
            cutoff = probs.max(dim=-1, keepdim=True).values * self._column([r.params.min_p for r in reqs])
            logits = logits.masked_fill(probs < cutoff, float("-inf"))
        top_k = [r.params.top_k for r in reqs]
        if any(top_k) or any(r.params.top_p < 1 for r in reqs):
            logits = self._top_k_top_p(logits, top_k, self._column([r.params.top_p for r in reqs])[:, 0])
        return logits.softmax(-1)

    @staticmethod
    def race(probs, reqs) -> torch.Tensor:
        """One draw per row from `probs` (unnormalized is fine): the exponential race (as vLLM), argmax(p / q) with
        q ~ Exp(1). Seeded rows draw q from their own generator, so their tokens do not depend on the batch."""
        q = torch.empty_like(probs)
        unseeded = Rows.where((r.generator is None for r in reqs), probs.device)
        # the same draws from the device's generator, in the same order, whichever way the rows are written
        if unseeded.every:
            q.exponential_()
        elif unseeded:
            unseeded.put(q, probs.new_empty((len(unseeded), probs.shape[1])).exponential_())
        for i, r in enumerate(reqs):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        return (probs / q).argmax(dim=-1)

    def _top_k_top_p(self, logits, top_k, top_p):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        v = logits.shape[-1]
        k = self._column([min(t, v) if t else v for t in top_k])[:, 0]  # any top_k >= v: all
        pos = torch.arange(v, device=self.device)[None, :]
        drop = pos >= k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
