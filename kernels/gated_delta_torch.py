"""Gated DeltaNet's conv and gated delta rule as torch code fast enough to serve with, where the Triton kernels do
not run (CPU): every sequence of a step at once, in a few batched ops, where the references (kernels/gated_delta.py)
loop over sequences and tokens in Python. Equal to them up to fp32 rounding (tests/kernels/test_gated_delta.py).

- The conv: each sequence's saved inputs and its rows laid side by side in one [C, T + B (W - 1)] buffer, the W taps
  as W shifted multiply-adds over all of it, the outputs and the new states gathered back.
- The rule: a step's one-token sequences (decodes) in one batched update; the longer ones padded into chunks of 64
  tokens and batched over (sequence, head, chunk) in the WY / UT-transform form of flash-linear-attention's chunked
  kernels and transformers' torch_chunk_gated_delta_rule; only the state's walk from chunk to chunk is a loop.
  Within a chunk of L tokens, with c = cumsum(g) and D[i, j] = exp(c_i - c_j) for j <= i (0 above):
    A = I + tril(diag(beta) K K^T * D, -1)        (unit lower triangular, inverted by forward substitution)
    U = A^-1 diag(beta) V,  W = A^-1 diag(beta exp(c)) K
    o = (Q * exp(c)) S + (Q K^T * D) (U - W S)
    S' = exp(c_L) S + (K * exp(c_L - c))^T (U - W S)
  Padded rows (k = v = beta = 0, g = 0) leave the state as it is."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Over the last dim, as flash-linear-attention (and transformers' l2norm) compute it."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv1d_torch(x, weight, bias, conv_state, query_start_loc, slots, activation: str | None = "silu"):
    """causal_conv1d_ref's contract: x [T, C]; weight [C, W]; conv_state [S, C, W - 1], each slot updated in place.
    Accumulates in fp32, rounds to the weight's dtype (as F.conv1d there), SiLU, then x's dtype."""
    w, starts, dev = weight.shape[1], [int(s) for s in query_start_loc], x.device
    at = torch.tensor([int(s) for s in slots], device=dev)
    state_cols, row_cols, last, end = [], [], [], 0  # columns of the side-by-side buffer: saved inputs, rows, the
    for b in range(len(starts) - 1):  # last W - 1 of each sequence's (its new state)
        n = starts[b + 1] - starts[b]
        state_cols += range(end, end + w - 1)
        row_cols += range(end + w - 1, end + w - 1 + n)
        end += w - 1 + n
        last += range(end - w + 1, end)
    state_cols, row_cols = (torch.tensor(c, device=dev) for c in (state_cols, row_cols))
    ext = torch.empty(x.shape[1], end, dtype=torch.float32, device=dev)  # [C, E]
    ext[:, state_cols] = conv_state[at].to(weight.dtype).float().permute(1, 0, 2).reshape(x.shape[1], -1)
    ext[:, row_cols] = x.to(weight.dtype).float().T
    wf = weight.float()
    y = sum(wf[:, j, None] * ext[:, j : end - w + 1 + j] for j in range(w))  # y[:, e]: the window ending at e + W - 1
    y = (y if bias is None else y + bias.float()[:, None]).to(weight.dtype)
    y = F.silu(y) if activation == "silu" else y
    conv_state[at] = ext[:, last].view(-1, len(starts) - 1, w - 1).permute(1, 0, 2).to(conv_state.dtype)
    return y[:, row_cols - (w - 1)].T.to(x.dtype)


def _unit_lower_inverse(n: torch.Tensor) -> torch.Tensor:
    """(I + n)^-1 for strictly lower triangular n [..., L, L], by forward substitution one row at a time (batched
    over the leading dims): torch's batched solve_triangular on CPU took 2 s for 256 blocks of 64 here."""
    inv = -n.clone()
    for i in range(1, n.shape[-1]):  # row i of the inverse from the rows above it
        row = inv[..., i, :i].clone()
        inv[..., i, :i] = row + (row.unsqueeze(-1) * inv[..., :i, :i]).sum(-2)
    return inv + torch.eye(n.shape[-1], dtype=n.dtype, device=n.device)


def _chunked(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences padded to C chunks: q (l2-normed, scaled), k (l2-normed) [B, H, C, L, Dk]; v [B, H, C, L, Dv];
    g, beta [B, H, C, L]; state [B, H, Dk, Dv]; fp32. Returns (o [B, H, C, L, Dv], the states after them)."""
    c = g.cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [B, H, C, L, L]
    kb = k * beta[..., None]
    inv = _unit_lower_inverse(((kb @ k.transpose(-1, -2)) * decay).tril(-1))  # A^-1
    u, w = inv @ (v * beta[..., None]), inv @ (kb * c.exp()[..., None])
    attn = (q @ k.transpose(-1, -2)) * decay
    qd = q * c.exp()[..., None]
    kd = k * (c[..., -1:] - c).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(q.shape[2]):
        fresh = u[:, :, i] - w[:, :, i] @ state  # [B, H, L, Dv]: what the state does not predict
        out[:, :, i] = qd[:, :, i] @ state + attn[:, :, i] @ fresh
        state = state * c[:, :, i, -1].exp()[..., None, None] + kd[:, :, i].transpose(-1, -2) @ fresh
    return out, state


def _one_token(q, k, v, g, beta, state) -> torch.Tensor:
    """Sequences of one token each (decodes): q, k [B, Hv, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; state
    [B, Hv, Dk, Dv] (their slots, gathered), updated in place. Returns o [B, Hv, Dv]."""
    state.mul_(g.exp()[..., None, None])
    delta = (v - torch.einsum("bhk,bhkv->bhv", k, state)) * beta[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q, state)


def gated_delta_rule_torch(q, k, v, g, beta, state, query_start_loc, slots) -> torch.Tensor:
    """gated_delta_rule_ref's contract (kernels/gated_delta.py): q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv];
    state [S, Hv, Dk, Dv] fp32, each sequence's slot updated in place. Returns o [T, Hv, Dv] in v's dtype."""
    hk, hv = k.shape[1], v.shape[1]
    qf, kf = (l2norm(x.float().repeat_interleave(hv // hk, dim=1)) for x in (q, k))  # [T, Hv, Dk]
    qf = qf * qf.shape[-1] ** -0.5
    vf, gf, bf = v.float(), g.float(), beta.float()
    out, dev = torch.empty(v.shape, dtype=torch.float32, device=v.device), v.device
    starts = [int(x) for x in query_start_loc]
    spans = [(starts[b], starts[b + 1] - starts[b], int(s)) for b, s in enumerate(slots)]
    singles, longer = [s for s in spans if s[1] == 1], [s for s in spans if s[1] > 1]
    if singles:
        rows, at = (torch.tensor(x, device=dev) for x in list(zip(*singles))[::2])
        s = state[at]  # a gathered copy
        out[rows] = _one_token(qf[rows], kf[rows], vf[rows], gf[rows], bf[rows], s)
        state[at] = s
    if longer:
        span = -(-max(n for _, n, _ in longer) // CHUNK) * CHUNK  # every sequence padded to this many rows
        src = torch.tensor([r for start, n, _ in longer for r in range(start, start + n)], device=dev)
        dst = torch.tensor([b * span + j for b, (_, n, _) in enumerate(longer) for j in range(n)], device=dev)

        def padded(x):  # [T, H, ...] -> [B, H, C, L, ...]
            buf = x.new_zeros(len(longer) * span, *x.shape[1:])
            buf[dst] = x[src]
            buf = buf.view(len(longer), span // CHUNK, CHUNK, *x.shape[1:])
            return buf.permute(0, 3, 1, 2, *range(4, buf.dim()))

        at = torch.tensor([s for *_, s in longer], device=dev)
        o, s = _chunked(*(padded(x) for x in (qf, kf, vf, gf, bf)), state[at])
        out[src] = o.permute(0, 2, 3, 1, 4).reshape(-1, *v.shape[1:])[dst]
        state[at] = s
    return out.to(v.dtype)
