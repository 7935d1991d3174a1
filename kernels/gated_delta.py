"""Gated DeltaNet's per-sequence state updates (Qwen3-Next and Qwen3.5's linear-attention layers, in
engine/models/qwen3_next.py) over the engine's varlen batch, and the gated RMSNorm after them. Torch references on
every device for now: the GPU kernels (flash-linear-attention's chunked rule and fused recurrent update) are not in yet.

A linear layer keeps, per running sequence, a fixed-size state in a slot of a pool (whatever the context length):
- a **conv state** [C, W - 1]: the last W - 1 inputs of the short causal depthwise conv1d (channels C, width W);
- a **recurrent state** [Hv, Dk, Dv] fp32: the gated delta rule's matrix per value head.
A step's rows for sequence b are query_start_loc[b]:query_start_loc[b + 1] (a prefill chunk or one decode token);
each starts from its slot's state and leaves the state after its last token there, so a prompt split into chunks
at any point gives the same outputs and final state as in one piece.

The gated delta rule (per value head, q and k l2-normalized, q scaled by Dk ** -0.5):
    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S
with S [Dk, Dv]; query / key heads serve Hv // Hk consecutive value heads. This is transformers'
torch_recurrent_gated_delta_rule token by token, the definition the chunked GPU kernels must match."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_ref(q, k, v, g, beta, state, query_start_loc, slots, l2norm_qk: bool = True) -> torch.Tensor:
    """q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log decay, <= 0), beta [T, Hv]; state [S, Hv, Dk, Dv] fp32, updated in
    place for each sequence's slot; query_start_loc [B + 1] and slots [B] (ints or tensors). Returns o [T, Hv, Dv] in
    v's dtype."""
    hk, hv = k.shape[1], v.shape[1]
    qf, kf = (x.float().repeat_interleave(hv // hk, dim=1) for x in (q, k))  # [T, Hv, Dk]
    if l2norm_qk:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * qf.shape[-1] ** -0.5
    vf, decay, bf = v.float(), g.float().exp(), beta.float()
    out = torch.empty_like(vf)
    starts = [int(x) for x in query_start_loc]
    for b, slot in enumerate(int(s) for s in slots):
        s = state[slot]  # [Hv, Dk, Dv]
        for t in range(starts[b], starts[b + 1]):
            s = s * decay[t, :, None, None]
            delta = (vf[t] - (s * kf[t, :, :, None]).sum(1)) * bf[t, :, None]  # [Hv, Dv]
            s = s + kf[t, :, :, None] * delta[:, None, :]
            out[t] = (s * qf[t, :, :, None]).sum(1)
        state[slot] = s
    return out.to(v.dtype)


def causal_conv1d_ref(x, weight, bias, conv_state, query_start_loc, slots, activation: str | None = "silu"):
    """The short causal depthwise conv over each sequence's rows, continuing from its slot's last inputs.
    x [T, C]; weight [C, W]; bias [C] or None; conv_state [S, C, W - 1], updated in place. Returns [T, C] in x's
    dtype (SiLU after, as Qwen3-Next)."""
    w = weight.shape[1]
    out = torch.empty_like(x)
    starts = [int(s) for s in query_start_loc]
    for b, slot in enumerate(int(s) for s in slots):
        rows = x[starts[b] : starts[b + 1]].T.to(weight.dtype)  # [C, n]
        full = torch.cat([conv_state[slot].to(weight.dtype), rows], dim=1)  # [C, W - 1 + n]
        y = F.conv1d(full[None], weight[:, None, :], bias, groups=weight.shape[0])[0]  # [C, n]
        conv_state[slot] = full[:, full.shape[1] - (w - 1) :].to(conv_state.dtype)
        y = F.silu(y) if activation == "silu" else y
        out[starts[b] : starts[b + 1]] = y.T.to(x.dtype)
    return out


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's gated RMSNorm over the last dim of x [..., D]: normalized in fp32, times the weight in x's dtype,
    times SiLU(gate) in fp32 (transformers' Qwen3NextRMSNormGated, rounding included)."""
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


# what the model calls: the references on every device until GPU kernels land beside them
causal_conv1d = causal_conv1d_ref
gated_delta_rule = gated_delta_rule_ref
gated_rms_norm = gated_rms_norm_ref
