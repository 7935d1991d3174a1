"""Verification of proposed tokens by rejection sampling, with vLLM v1's semantics.

A speculating sequence with drafts d_1..d_k gets k + 1 logits rows from the target's forward pass: row j scores
the token after d_1..d_j. Every row is processed exactly as the sampler processes a plain decode row at that
position (min_tokens mask, logit_bias, penalties counting d_1..d_j, temperature, min_p, top_k, top_p; a grammar's
mask was applied to the logits before), giving the target distribution p_j. Then, in order:

- greedy: d_{j+1} is accepted while it equals argmax p_j; the first mismatch emits the target's argmax instead;
- random: d_{j+1} is accepted with probability min(1, p_j(d) / q_j(d)), where q_j is the draft's distribution
  (one-hot, q = 1, for n-gram proposals); on the first rejection the token is drawn from max(p_j - q_j, 0)
  normalized. This keeps every emitted token distributed exactly as p (Leviathan et al., 2023);
- when all k are accepted, the bonus token is drawn from p_k.

Seeded sequences draw their uniforms and exponentials from their own generator, row by row, so their tokens
do not depend on the rest of the batch. All rows are decided on the device and come to the host in one copy."""

from __future__ import annotations

import torch

from engine.block_table import h2d
from engine.sampler import Rows, Sampler
from engine.types import Request


class Row:
    """A request seen at one verification position: its output so far plus the drafts before that row (what the
    sampler's min_tokens mask and penalties read)."""

    __slots__ = ("req", "output_token_ids")

    def __init__(self, req: Request, output_token_ids: list[int]):
        self.req, self.output_token_ids = req, output_token_ids

    params = property(lambda self: self.req.params)
    prompt_token_ids = property(lambda self: self.req.prompt_token_ids)
    eos_token_ids = property(lambda self: self.req.eos_token_ids)
    generator = property(lambda self: self.req.generator)


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    reqs: list[Request],
    drafts: list[list[int]],
    draft_probs: dict[Request, torch.Tensor] | None = None,
) -> tuple[list[list[int]], list[list[dict] | None]]:
    """logits: [sum(len(d) + 1), vocab] fp32, each request's rows consecutive. draft_probs: a sampled draft's
    q rows ([>= len(d), vocab]) per request; absent = one-hot. Returns per request the emitted tokens (accepted
    drafts then one target token) and, for those that asked, their top-N logprobs."""
    rows: list = []
    draft_tok: list[int] = []
    for req, ds in zip(reqs, drafts):
        for j in range(len(ds) + 1):
            rows.append(Row(req, req.output_token_ids + ds[:j]) if j else req)
            draft_tok.append(ds[j] if j < len(ds) else -1)
    raw = sampler._raw_logprobs(logits, rows)
    lg, bad = sampler.screen(logits)  # a copy; a row with NaN or +inf logits samples -1 (its request fails)
    sampler._mask_min_tokens(lg, rows)
    sampler._apply_logit_bias(lg, rows)
    sampler._apply_penalties(lg, rows)
    dev = lg.device
    tok = lg.argmax(dim=-1)  # greedy rows: the target's choice
    d = h2d(draft_tok, torch.int64, dev)
    accept = tok == d
    rand = Rows.where((not r.params.greedy for r in rows), dev)
    if rand:
        rr = [rows[i] for i in rand.rows]
        p = sampler.probs(rand.take(lg), rr)  # [Rr, vocab], what a plain step would draw from
        dr = rand.take(d)
        has = dr >= 0
        q = _draft_q(p, rows, rand.rows, draft_tok, draft_probs)
        di = dr.clamp(min=0)[:, None]
        p_d, q_d = p.gather(1, di)[:, 0], q.gather(1, di)[:, 0]
        u = _uniform(rr, [draft_tok[i] >= 0 for i in rand.rows], dev)
        rand.put(accept, has & (u * q_d < p_d))  # strict: a token with p = 0 is never accepted
        residual = torch.where(has[:, None], (p - q).clamp_min(0), p)  # rows without a draft: p itself
        rand.put(tok, sampler.race(residual, rr))
    tok.masked_fill_(bad, -1)
    accept &= ~bad
    host = torch.stack([tok, accept.to(tok.dtype)]).tolist()  # one copy to the host
    tokens, accepted = host[0], host[1]
    out_tokens, emitted_rows, row = [], [], 0
    for ds in drafts:
        a = 0
        while a < len(ds) and accepted[row + a]:
            a += 1
        out_tokens.append(ds[:a] + [tokens[row + a]])
        emitted_rows.append(range(row, row + a + 1))
        row += len(ds) + 1
    if raw is None:
        return out_tokens, [None] * len(reqs)
    chosen = [draft_tok[i] if accepted[i] and draft_tok[i] >= 0 else tokens[i] for i in range(len(rows))]
    lps = sampler._pick_logprobs(raw, rows, chosen)
    return out_tokens, [[lps[i] for i in rs] if lps[rs[0]] is not None else None for rs in emitted_rows]


def _draft_q(p, rows, rand, draft_tok, draft_probs) -> torch.Tensor:
    """q per random row: the draft model's distribution where it sampled, else one-hot at the draft token
    (n-gram, a greedy draft, or no draft: then zeros, unused)."""
    q = torch.zeros_like(p)
    pos = [(k, i) for k, i in enumerate(rand) if draft_tok[i] >= 0]
    if pos:  # one pinned copy of the (row, token) pairs, not a list-indexed write (a blocking copy on CUDA)
        at = h2d([[k for k, _ in pos], [draft_tok[i] for _, i in pos]], torch.int64, p.device)
        q[at[0], at[1]] = 1.0
    where, sampled = [], []
    for k, i in enumerate(rand):
        row = rows[i]
        req = row.req if isinstance(row, Row) else row
        qs = draft_probs.get(req) if draft_probs else None
        j = len(row.output_token_ids) - len(req.output_token_ids)  # this row's position among the drafts
        if qs is not None and draft_tok[i] >= 0:
            where.append(k)
            sampled.append(qs[j])
    if where:  # the sampled drafts' rows in one write
        q.index_copy_(0, h2d(where, torch.int64, p.device), torch.stack(sampled))
    return q


def _uniform(rows, has_draft: list[bool], dev) -> torch.Tensor:
    """One uniform per row that has a draft to accept. A seeded row draws only then, so a row without a draft uses
    its generator exactly as a plain step does, whatever else is in the batch."""
    u = torch.rand(len(rows), device=dev)
    for i, (r, has) in enumerate(zip(rows, has_draft)):
        if r.generator is not None and has:
            u[i] = torch.rand(1, device=dev, generator=r.generator)[0]
    return u
