"""Gated DeltaNet's per-sequence state updates (Qwen3-Next and Qwen3.5's linear-attention layers, in
engine/models/qwen3_next.py) over the engine's varlen batch, and the gated RMSNorm after them. Torch references on
every device, and Triton kernels (below) on the GPU.

A linear layer keeps, per running sequence, a fixed-size state in a slot of a pool (whatever the context length):
- a **conv state** [C, W - 1]: the last W - 1 inputs of the short causal depthwise conv1d (channels C, width W);
- a **recurrent state** [Hv, Dk, Dv] fp32: the gated delta rule's matrix per value head.
A step's rows for sequence b are query_start_loc[b]:query_start_loc[b + 1] (a prefill chunk or one decode token);
each starts from its slot's state and leaves the state after its last token there, so a prompt split into chunks
at any point gives the same outputs and final state as in one piece.

The gated delta rule (per value head, q and k l2-normalized, q scaled by Dk ** -0.5):
    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S
with S [Dk, Dv]; query / key heads serve Hv // Hk consecutive value heads. This is transformers'
torch_recurrent_gated_delta_rule token by token, the definition a chunked GPU kernel must match.

The Triton kernels beside each reference (CUDA tensors, or the backend forced to triton):
- `_causal_conv1d_kernel`: a program per (sequence, channel block) walks its rows BLOCK_T at a time, each tap
  reading x or, before the sequence's first row, the slot's conv state; the slot gets the last W - 1 inputs back.
- `_gated_delta_kernel`: the fused recurrent form (flash-linear-attention's fused_recurrent_gated_delta_rule,
  varlen with slots): a program per (sequence, value head, Dv block) keeps its [Dk, BLOCK_DV] of S in fp32
  registers over the sequence's tokens. One token at a time: right for decodes, slow for long prefills (a chunked
  kernel would do those with tl.dot).
- `_gated_rms_norm_kernel`: one (token, head) row per program.
Each rounds where its reference does (_common.round_to). query_start_loc and slots come from the model as host
lists: one pinned copy makes them int32 device tensors (tensors are taken as they are)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._common import cdiv, jit, next_power_of_2, round_to, tl, use_triton
from kernels._library import triton_op
from kernels.gated_delta_torch import causal_conv1d_torch, gated_delta_rule_torch, l2norm


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


@jit
def _gated_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, qsl_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh, DK, DV, GROUP, scale,
    L2NORM: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # grid (B, Hv, cdiv(Dv, BLOCK_DV)); q, k rows [Dk], v, o rows [Dv] (last dims contiguous); g, beta [T, Hv]
    b, h = tl.program_id(0), tl.program_id(1)
    kh = h // GROUP  # the query / key head of value head h
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    kmask, vmask = dk < DK, dv < DV
    start, end = tl.load(qsl_ptr + b), tl.load(qsl_ptr + b + 1)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    sp = state_ptr + slot * stride_ss + h * stride_sh + dk[:, None] * stride_sk + dv[None, :]  # [BLOCK_DK, BLOCK_DV]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(sp, mask=smask, other=0.0)  # fp32
    odt = o_ptr.dtype.element_ty
    for i in range(0, end - start):
        t64 = start.to(tl.int64) + i
        q = tl.load(q_ptr + t64 * stride_qt + kh * stride_qh + dk, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t64 * stride_kt + kh * stride_kh + dk, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + dv, mask=vmask, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + t64 * stride_gt + h).to(tl.float32))
        beta = tl.load(beta_ptr + t64 * stride_bt + h).to(tl.float32)
        if L2NORM:  # l2norm, eps 1e-6
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        s = s * decay
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BLOCK_DV]
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)  # [BLOCK_DV]
        tl.store(o_ptr + t64 * stride_ot + h * stride_oh + dv, round_to(o, odt).to(odt), mask=vmask)
    tl.store(sp, s, mask=smask)


def _index(query_start_loc, slots, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """query_start_loc [B + 1] and slots [B] as int32 tensors on `device`; host lists in one copy."""
    if isinstance(query_start_loc, torch.Tensor) and isinstance(slots, torch.Tensor):
        return query_start_loc.to(device, torch.int32), slots.to(device, torch.int32)
    pin = device.type == "cuda"
    both = torch.tensor([*map(int, query_start_loc), *map(int, slots)], dtype=torch.int32, pin_memory=pin)
    both = both.to(device, non_blocking=True)
    return both[: len(query_start_loc)], both[len(query_start_loc) :]


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()  # the kernels take any other strides


@triton_op(
    "gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, "
    "Tensor query_start_loc, Tensor slots, bool l2norm_qk=True) -> Tensor",
    lambda q, k, v, *args, **kwargs: v.new_empty(v.shape),
)
def gated_delta_rule_triton(q, k, v, g, beta, state, query_start_loc, slots, l2norm_qk: bool = True):
    q, k, v, g, beta = (_rows(x) for x in (q, k, v, g, beta))
    (t, hk, dk), (hv, dv) = k.shape, v.shape[1:]
    assert q.shape == k.shape and v.shape[0] == t and hv % hk == 0, (q.shape, k.shape, v.shape)
    assert g.shape == beta.shape == (t, hv), (g.shape, beta.shape)
    assert state.dtype == torch.float32 and state.shape[1:] == (hv, dk, dv) and state.stride(-1) == 1, state.shape
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # [T, Hv, Dv]
    b = slots.shape[0]
    if b == 0 or t == 0:
        return out
    block_dk = next_power_of_2(dk)
    # S's tile in registers: 4096 fp32 over 4 warps' 128 threads, 32 each (Dk 128: Dv in blocks of 32)
    block_dv = min(next_power_of_2(dv), max(4096 // block_dk, 8))
    _gated_delta_kernel[(b, hv, cdiv(dv, block_dv))](
        q, k, v, g, beta, state, out, query_start_loc, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1), dk, dv, hv // hk, dk**-0.5,
        L2NORM=l2norm_qk, BLOCK_DK=block_dk, BLOCK_DV=block_dv, num_warps=4,
    )  # fmt: skip
    return out


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


@jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, qsl_ptr, slot_ptr, stride_xt, stride_wc, stride_ss, stride_sc,
    stride_ot, C, W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    # grid (B, cdiv(C, BLOCK_C)); x, out [T, C]; w [C, W]; state [S, C, W - 1] (channels' last dims contiguous)
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    cmask = cols < C
    start, end = tl.load(qsl_ptr + b), tl.load(qsl_ptr + b + 1)
    n = end - start
    st = state_ptr + tl.load(slot_ptr + b).to(tl.int64) * stride_ss + cols[None, :] * stride_sc  # [1, BLOCK_C]
    xs = x_ptr + start.to(tl.int64) * stride_xt + cols[None, :]  # [1, BLOCK_C]: the sequence's first row
    wdt = w_ptr.dtype.element_ty  # (one dtype per assignment: the compiler takes no tuple of dtypes)
    odt = out_ptr.dtype.element_ty
    sdt = state_ptr.dtype.element_ty
    bias = tl.zeros([BLOCK_C], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    for t0 in range(0, n, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)[:, None]  # [BLOCK_T, 1], within the sequence
        live = (rows < n) & cmask[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32) + bias[None, :]
        for j in tl.static_range(W):
            p = rows + (j - (W - 1))  # the input tap j reads; p < 0: the state's column W - 1 + p
            xv = tl.load(xs + p.to(tl.int64) * stride_xt, mask=live & (p >= 0), other=0.0).to(tl.float32)
            sv = tl.load(st + (p + W - 1), mask=live & (p < 0), other=0.0).to(tl.float32)
            wj = tl.load(w_ptr + cols * stride_wc + j, mask=cmask, other=0.0).to(tl.float32)
            acc += round_to(tl.where(p >= 0, xv, sv), wdt) * wj[None, :]  # the inputs in weight's dtype
        y = round_to(acc, wdt)  # F.conv1d's output, in weight's dtype
        if SILU:
            y = round_to(y / (1.0 + tl.exp(-y)), wdt)
        tl.store(out_ptr + (start + rows).to(tl.int64) * stride_ot + cols[None, :], round_to(y, odt).to(odt), mask=live)
    # the new state: column c is input n - (W - 1) + c, from x or (a sequence shorter than W - 1) the old state
    c = tl.arange(0, BLOCK_W)[:, None]  # [BLOCK_W, 1]
    p = n - (W - 1) + c
    keep = (c < W - 1) & cmask[None, :]
    xv = tl.load(xs + p.to(tl.int64) * stride_xt, mask=keep & (p >= 0), other=0.0).to(tl.float32)
    sv = tl.load(st + (p + W - 1), mask=keep & (p < 0), other=0.0).to(tl.float32)
    new = round_to(round_to(tl.where(p >= 0, xv, sv), wdt), sdt).to(sdt)
    tl.debug_barrier()  # every thread's reads of the old state (above and in the loop) before any write
    tl.store(st + c, new, mask=keep)


@triton_op(
    "causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, Tensor query_start_loc, "
    "Tensor slots, bool silu=True) -> Tensor",
    lambda x, *args, **kwargs: x.new_empty(x.shape),
)
def causal_conv1d_triton(x, weight, bias, conv_state, query_start_loc, slots, silu: bool = True) -> torch.Tensor:
    x = _rows(x)
    (t, c), w = x.shape, weight.shape[1]
    assert weight.shape == (c, w) and weight.stride(1) == 1, (x.shape, weight.shape)
    assert conv_state.shape[1:] == (c, w - 1) and (w == 1 or conv_state.stride(2) == 1), conv_state.shape
    assert bias is None or (bias.shape == (c,) and bias.is_contiguous())
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, C]
    b = slots.shape[0]
    if b == 0 or t == 0:
        return out
    block_c = min(next_power_of_2(c), 128)
    _causal_conv1d_kernel[(b, cdiv(c, block_c))](
        x, weight, bias if bias is not None else weight, conv_state, out, query_start_loc, slots,
        x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0), c,
        W=w, HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=8, BLOCK_C=block_c, BLOCK_W=next_power_of_2(w - 1),
    )  # fmt: skip
    return out


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's gated RMSNorm over the last dim of x [..., D]: normalized in fp32, times the weight in x's dtype,
    times SiLU(gate) in fp32 (transformers' Qwen3NextRMSNormGated, rounding included)."""
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


@jit
def _gated_rms_norm_kernel(
    x_ptr, gate_ptr, w_ptr, out_ptr, stride_xt, stride_xh, stride_gt, stride_gh, stride_ot, stride_oh, D, eps,
    ROUND_Y: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # grid (N, H); x, gate, out [N, H, D] (last dim contiguous); w [D]
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
    y = round_to(x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps), dt)  # normalized, in x's dtype
    y = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * y
    if ROUND_Y:  # weight * y in x's dtype (not when the weight's dtype promotes it)
        y = round_to(y, dt)
    gate = tl.load(gate_ptr + t * stride_gt + h * stride_gh + cols, mask=mask, other=0.0).to(tl.float32)
    y = y * (gate / (1.0 + tl.exp(-gate)))  # SiLU(gate) in fp32
    tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, round_to(y, dt).to(dt), mask=mask)


def _heads(x: torch.Tensor) -> torch.Tensor:
    return _rows(x.unsqueeze(-2) if x.dim() == 2 else x.reshape(-1, *x.shape[-2:]))  # [N, H, D]


@triton_op(
    "gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps) -> Tensor",
    lambda x, *args, **kwargs: x.new_empty(x.shape),
)
def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    assert x.dim() >= 2 and gate.shape == x.shape and weight.shape == (d,), (x.shape, gate.shape, weight.shape)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3, g3, o3, w = _heads(x), _heads(gate), _heads(out), weight.contiguous()
    if x3.numel() == 0:
        return out
    _gated_rms_norm_kernel[x3.shape[:2]](
        x3, g3, w, o3, x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), o3.stride(0), o3.stride(1), d, eps,
        ROUND_Y=torch.promote_types(weight.dtype, x.dtype) == x.dtype, BLOCK=next_power_of_2(d),
    )  # fmt: skip
    return out


# what the model calls: the Triton kernels on CUDA tensors (or the backend forced to triton), else the references
def gated_delta_rule(q, k, v, g, beta, state, query_start_loc, slots, l2norm_qk: bool = True) -> torch.Tensor:
    """As gated_delta_rule_ref: o [T, Hv, Dv] in v's dtype; state [S, Hv, Dk, Dv] fp32 updated in place."""
    if not use_triton(v) and not l2norm_qk:
        return gated_delta_rule_ref(q, k, v, g, beta, state, query_start_loc, slots, l2norm_qk)
    if not use_triton(v):  # the torch path: batched decodes, prefill in 64-token chunks (the reference's math)
        return gated_delta_rule_torch(q, k, v, g, beta, state, query_start_loc, slots)
    qsl, slots = _index(query_start_loc, slots, v.device)
    return gated_delta_rule_triton(q, k, v, g, beta, state, qsl, slots, l2norm_qk)


def causal_conv1d(x, weight, bias, conv_state, query_start_loc, slots, activation: str | None = "silu"):
    """As causal_conv1d_ref: [T, C] in x's dtype; conv_state [S, C, W - 1] updated in place."""
    assert activation in ("silu", None), activation
    if not use_triton(x):  # the torch path: every sequence at once
        return causal_conv1d_torch(x, weight, bias, conv_state, query_start_loc, slots, activation)
    qsl, slots = _index(query_start_loc, slots, x.device)
    return causal_conv1d_triton(x, weight, bias, conv_state, qsl, slots, activation == "silu")


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As gated_rms_norm_ref, over x [..., H, D] (or [N, D])."""
    return gated_rms_norm_triton(x, gate, weight, eps) if use_triton(x) else gated_rms_norm_ref(x, gate, weight, eps)
