"""Gated DeltaNet's conv and gated delta rule as torch code fast enough to serve with, where the Triton kernels do
not run (CPU): every sequence of a step at once, in a few batched ops, where the references (kernels/gated_delta.py)
loop over sequences and tokens in Python. Equal to them up to fp32 rounding (tests/kernels/test_gated_delta.py).

- The conv: each sequence's saved inputs and its rows laid side by side in one [C, T + B (W - 1)] buffer, the W taps
  as W shifted multiply-adds over all of it, the outputs and the new states gathered back.
- The rule: a step's one-token sequences (decodes) in one batched update; the longer ones cut into chunks of 64
  tokens (each one's last padded) and batched over (chunk, head) in the WY / UT-transform form of
  flash-linear-attention's chunked kernels and transformers' torch_chunk_gated_delta_rule; only the state's walk
  from chunk to chunk is a loop.
  Within a chunk of L tokens, with c = cumsum(g) and D[i, j] = exp(c_i - c_j) for j <= i (0 above):
    A = I + tril(diag(beta) K K^T * D, -1)        (unit lower triangular)
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


def _chunked(q, k, v, g, beta, state, chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """N chunks of L rows (a sequence's last one padded): q (l2-normed, scaled), k (l2-normed) [N, H, L, Dk];
    v [N, H, L, Dv]; g, beta [N, H, L]; state [B, H, Dk, Dv]; fp32. chunks[b]: sequence b's chunk indices, in order.
    Everything within a chunk is batched over all N; only the state's walk from chunk to chunk is a loop, over the
    i-th chunks of every sequence that has one. Returns (o [N, H, L, Dv], the states after each sequence's last)."""
    c = g.cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [N, H, L, L]
    kb = k * beta[..., None]
    a = ((kb @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(CHUNK, device=q.device)  # unit lower triangular
    eye = torch.eye(CHUNK, device=q.device).expand_as(a)
    inv = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)  # A^-1 (fast with a contiguous
    u, w = inv @ (v * beta[..., None]), inv @ (kb * c.exp()[..., None])  # identity; 100x slower on strided rhs)
    attn = (q @ k.transpose(-1, -2)) * decay
    qd = q * c.exp()[..., None]
    kd = k * (c[..., -1:] - c).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(max(len(ids) for ids in chunks)):
        seqs = [b for b, ids in enumerate(chunks) if len(ids) > i]
        at = torch.tensor([chunks[b][i] for b in seqs], device=q.device)
        s = state if len(seqs) == len(chunks) else state[seqs]
        fresh = u[at] - w[at] @ s  # [b, H, L, Dv]: what the state does not predict
        out[at] = qd[at] @ s + attn[at] @ fresh
        s = s * c[at, :, -1].exp()[..., None, None] + kd[at].transpose(-1, -2) @ fresh
        if len(seqs) == len(chunks):
            state = s
        else:
            state[seqs] = s
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
    if longer:  # each sequence's rows in chunks of CHUNK (its last one padded), all chunks side by side
        src, dst, chunks = [], [], []
        for start, n, _ in longer:
            first = len(dst) and dst[-1] // CHUNK + 1  # this sequence's first chunk
            chunks.append(list(range(first, first + -(-n // CHUNK))))
            src += range(start, start + n)
            dst += range(first * CHUNK, first * CHUNK + n)
        src, dst = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        rows = (chunks[-1][-1] + 1) * CHUNK

        def padded(x):  # [T, H, ...] -> [N, H, L, ...]
            buf = x.new_zeros(rows, *x.shape[1:])
            buf[dst] = x[src]
            return buf.view(-1, CHUNK, *x.shape[1:]).transpose(1, 2).contiguous()

        at = torch.tensor([s for *_, s in longer], device=dev)
        o, s = _chunked(*(padded(x) for x in (qf, kf, vf, gf, bf)), state[at], chunks)
        out[src] = o.transpose(1, 2).reshape(-1, *v.shape[1:])[dst]
        state[at] = s
    return out.to(v.dtype)
