"""The gated delta rule as torch code fast enough to serve with, where the Triton kernels do not run (CPU): a step's
one-token sequences (decodes) in one batched update, longer ones in chunks of 64 tokens (the WY / UT-transform form
of flash-linear-attention's chunked kernels and transformers' torch_chunk_gated_delta_rule): a few batched matmuls
per 64 tokens instead of a Python loop of rank-1 updates per token. Equal to kernels/gated_delta.py's
gated_delta_rule_ref up to fp32 rounding (tests/kernels/test_gated_delta.py).

Within a chunk of L tokens, with c = cumsum(g) and D[i, j] = exp(c_i - c_j) for j <= i (0 above):
    A = I + tril(diag(beta) K K^T * D, -1)        (unit lower triangular, inverted by forward substitution)
    U = A^-1 diag(beta) V,  W = A^-1 diag(beta exp(c)) K
    o = (Q * exp(c)) S + (Q K^T * D) (U - W S)
    S' = exp(c_L) S + (K * exp(c_L - c))^T (U - W S)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Over the last dim, as flash-linear-attention (and transformers' l2norm) compute it."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _unit_lower_inverse(n: torch.Tensor) -> torch.Tensor:
    """(I + n)^-1 for strictly lower triangular n [..., L, L], by forward substitution one row at a time (batched
    over the leading dims): torch's batched solve_triangular on CPU took 2 s for 256 blocks of 64 here."""
    inv = -n.clone()
    for i in range(1, n.shape[-1]):  # row i of the inverse from the rows above it
        row = inv[..., i, :i].clone()
        inv[..., i, :i] = row + (row.unsqueeze(-1) * inv[..., :i, :i]).sum(-2)
    return inv + torch.eye(n.shape[-1], dtype=n.dtype, device=n.device)


def _sequence(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q (l2-normed, scaled), k (l2-normed) [Hv, n, Dk]; v [Hv, n, Dv]; g, beta [Hv, n]; state
    [Hv, Dk, Dv]; all fp32. Returns (o [Hv, n, Dv], the state after the last token)."""
    h, n = q.shape[:2]
    pad = -n % CHUNK  # padded rows: k = v = beta = 0 and g = 0 leave the state as it is
    q, k, v = (F.pad(x, (0, 0, 0, pad)).view(h, -1, CHUNK, x.shape[-1]) for x in (q, k, v))  # [H, C, L, D]
    g, beta = (F.pad(x, (0, pad)).view(h, -1, CHUNK) for x in (g, beta))  # [H, C, L]
    c = g.cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [H, C, L, L]
    kb = k * beta[..., None]
    inv = _unit_lower_inverse(((kb @ k.transpose(-1, -2)) * decay).tril(-1))  # A^-1 [H, C, L, L]
    u, w = inv @ (v * beta[..., None]), inv @ (kb * c.exp()[..., None])
    attn = (q @ k.transpose(-1, -2)) * decay
    qd = q * c.exp()[..., None]
    kd = k * (c[..., -1:] - c).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        fresh = u[:, i] - w[:, i] @ state  # [H, L, Dv]: what the state does not predict
        out[:, i] = qd[:, i] @ state + attn[:, i] @ fresh
        state = state * c[:, i, -1].exp()[:, None, None] + kd[:, i].transpose(-1, -2) @ fresh
    return out.view(h, -1, v.shape[-1])[:, :n], state


def _one_token(q, k, v, g, beta, state) -> torch.Tensor:
    """Sequences of one token each (decodes), batched: q, k [B, Hv, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; state
    [B, Hv, Dk, Dv] (their slots, gathered), updated in place. Returns o [B, Hv, Dv]."""
    state.mul_(g.exp()[..., None, None])
    delta = (v - torch.einsum("bhk,bhkv->bhv", k, state)) * beta[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q, state)


def gated_delta_rule_chunked(q, k, v, g, beta, state, query_start_loc, slots) -> torch.Tensor:
    """gated_delta_rule_ref's contract (kernels/gated_delta.py): q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv];
    state [S, Hv, Dk, Dv] fp32, each sequence's slot updated in place. Returns o [T, Hv, Dv] in v's dtype. The
    one-token sequences of a step go together through one batched update; longer ones in chunks, one by one."""
    hk, hv = k.shape[1], v.shape[1]
    qf, kf = (l2norm(x.float().repeat_interleave(hv // hk, dim=1)) for x in (q, k))  # [T, Hv, Dk]
    qf = qf * qf.shape[-1] ** -0.5
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    starts = [int(x) for x in query_start_loc]
    singles = []  # (row, slot) of one-token sequences
    for b, slot in enumerate(int(s) for s in slots):
        if starts[b + 1] - starts[b] == 1:
            singles.append((starts[b], slot))
            continue
        rows = slice(starts[b], starts[b + 1])
        o, s = _sequence(*(x[rows].transpose(0, 1) for x in (qf, kf, vf, gf, bf)), state[slot])
        out[rows] = o.transpose(0, 1)
        state[slot] = s
    if singles:
        rows, at = (torch.tensor(x, device=v.device) for x in zip(*singles))
        s = state[at]  # a gathered copy
        out[rows] = _one_token(qf[rows], kf[rows], vf[rows], gf[rows], bf[rows], s)
        state[at] = s
    return out.to(v.dtype)
