"""Fused mixture-of-experts MLP (vLLM's fused_moe, in its shape): Triton grouped GEMM, launcher and torch reference.

x [T, H]; w13 [E, 2I, H] (each expert's gate rows then up rows); w2 [E, H, I]; topk_ids / topk_weights [T, K];
optional biases b13 [E, 2I] (gate then up), b2 [E, H] (GPT-OSS's experts).
out[t] = sum_k topk_weights[t, k] * (w2[e] @ act_and_mul(w13[e] @ x[t] + b13[e]) + b2[e]), e = topk_ids[t, k].

- Alignment (`moe_align`, device ops only, no host sync): the T*K (token, k) slots are sorted by expert and each
  expert's run is padded to the block size with a sentinel slot, so every block of the sorted list belongs to one
  expert; `expert_of_block` names it (-1: past the end). The list has its worst-case length, so its size is
  known on the host without reading the counts back.
- Block size (`block_size_for`, from the shapes alone): 16 rows while the experts' runs are short (decode), 64
  when they are long (prefill), with wider tiles and more pipeline stages (`tiles`): a long run then reads each
  weight tile once per 64 rows, not per 16, and tl.dot runs at M = 64.
- GEMM (`_moe_gemm_kernel`): one program per (block of sorted slots, BLOCK_N output columns) multiplies the
  block's rows by its expert's weight tile, K-loop in fp32. The first GEMM reads x's row slot // K; the second
  reads the activation's row slot and multiplies by the slot's top-k weight in its epilogue. fp8 (e4m3) weights
  are widened in the loop and their per-expert, per-output-channel scales applied after it; then the expert's
  bias row is added (before the top-k weight, as HF's GPT-OSS). MXFP4 weights (uint8; kernels/mxfp4.py: two e2m1
  codes a byte, an e8m0 scale per 32 K elements; GPT-OSS's experts) stay 4-bit in memory: each K step loads the
  tile's bytes and scales and decodes them (`mxfp4_tile`), as Hopper has no FP4 tensor cores. On a GPU 16-bit
  operands go to tl.dot as they are (tensor cores); elsewhere (the interpreter) in fp32.
- The activation between them is kernels.activation's (SiLU, GELU-tanh or, with `swiglu=(alpha, limit)`,
  GPT-OSS's clamped SwiGLU, and mul); the K partial rows of a token are summed last, in fp32.
The reference (the CPU path) runs one matmul pair per expert that has tokens, over its gathered tokens: never a
loop over tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._common import FP8, cdiv, jit, native_dot_for, next_power_of_2, round_to, tl, use_triton
from kernels._library import triton_op
from kernels.activation import gelu_tanh_and_mul, silu_and_mul, swiglu_oai_and_mul
from kernels.mxfp4 import dequantize_mxfp4_ref, mxfp4_k, mxfp4_tile

BLOCK_M = 16  # decode-sized blocks; tl.dot wants every block dim >= 16
BLOCK_M_LARGE = 64  # prefill-sized blocks
# The mean rows per expert (slots / experts) from which the large blocks are used. Padding each run to 64 rows then
# costs at most about 2x the rows on average, while each weight tile is read a quarter as often: a decode step's
# runs are a few rows and keep 16-row blocks. Known on the host from the shapes alone: no look at the routing.
LARGE_RUN = 32


def block_size_for(num_slots: int, num_experts: int) -> int:
    """The rows per block for a step of `num_slots` (token, expert) slots: 16 while the mean run is short."""
    return BLOCK_M if num_slots < LARGE_RUN * num_experts else BLOCK_M_LARGE


def tiles(block: int, n: int, k: int, native_dot: bool) -> dict:
    """The GEMMs' tile and launch configuration for blocks of `block` rows and a weight of shape [N, K]. 16-row
    blocks: tiles up to 64 x 64, triton's default 4 warps and 3 stages (what decode steps always ran). 64-row
    blocks: 64 x 128 output tiles with a K step of 32 and 4 warps, a tile Triton's matmul tutorial tunes, with 4
    stages of 16-bit operands (48 KiB of shared memory) or 3 of fp32 ones (72 KiB), within the 99 KiB an sm89
    block may use."""
    small = block == BLOCK_M
    cap_n, cap_k = (64, 64) if small else (128, 32)
    return dict(
        BLOCK=block,
        BLOCK_N=min(cap_n, max(16, next_power_of_2(n))),
        BLOCK_K=min(cap_k, max(16, next_power_of_2(k))),
        num_warps=4,
        num_stages=3 if small or not native_dot else 4,
    )


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """topk_ids [T, K] -> (sorted_slots [P] int32, expert_of_block [P / block_m] int32), P the worst case
    T*K + E*(block_m - 1) rounded up to block_m; sentinel slot T*K pads each expert's run."""
    flat = topk_ids.flatten().to(torch.int64)  # [S], slot s = t * K + k
    s = flat.numel()
    # [E]; scatter_add, not bincount: CUDA's bincount reads the max back to size its output (a sync; no graphs)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)  # slots by expert
    by_expert = flat[order]
    rank = torch.arange(s, device=flat.device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    dest = (torch.cumsum(padded, 0) - padded)[by_expert] + rank
    p = -(-(s + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_slots = torch.full((p,), s, dtype=torch.int32, device=flat.device)
    sorted_slots[dest] = order.to(torch.int32)
    starts = torch.arange(0, p, block_m, device=flat.device)
    ends = torch.cumsum(padded, 0)
    expert = torch.searchsorted(ends, starts, right=True)  # the expert whose padded run holds the block
    expert_of_block = torch.where(starts < ends[-1], expert, -1).to(torch.int32)
    return sorted_slots, expert_of_block


@jit(do_not_specialize=["num_slots"])
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    scale_ptr,
    bias_ptr,
    w_ptr,
    sorted_ptr,
    expert_ptr,
    num_slots,
    N,
    K,
    top_k,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_se,
    stride_sn,  # MXFP4: the scales' row stride
    stride_bias_e,
    FIRST: tl.constexpr,  # the first GEMM: A's row is slot // top_k (the token)
    MUL_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    MXFP4: tl.constexpr,  # uint8 weights [E, N, K // 2], e8m0 scales [E, N, K // 32] (kernels/mxfp4.py)
    HAS_BIAS: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    slot = tl.load(sorted_ptr + pid_m * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)  # [BLOCK]
    ok = slot < num_slots
    row = slot // top_k if FIRST else slot
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + row[:, None] * stride_am + offs_k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        if MXFP4:  # the tile's bytes and scales, decoded in fp32 (exact); to the dot's dtype below
            w = mxfp4_tile(
                b_ptr + e * stride_be, scale_ptr + e * stride_se, offs_n, n_ok, k0, K, stride_bn, stride_sn,
                BLOCK_N, BLOCK_K,
            )  # fmt: skip
            b = tl.trans(w)  # [BLOCK_K, BLOCK_N]
        else:
            b = tl.load(
                b_ptr + e * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
                mask=k_ok[:, None] & n_ok[None, :],
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]
        if NATIVE_DOT:  # 16-bit operands on the tensor cores (fp8 weights widened to them), fp32 accumulation
            acc += tl.dot(a, b.to(a.dtype))
        else:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if HAS_SCALE:  # fp8 weights: the expert's per-output-channel scales
        acc = acc * tl.load(scale_ptr + e * stride_se + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:  # the expert's bias row, inside the top-k weighting
        acc = acc + tl.load(bias_ptr + e * stride_bias_e + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + slot, mask=ok, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c_ptr + slot[:, None] * stride_cm + offs_n[None, :],
        round_to(acc, c_ptr.dtype.element_ty).to(c_ptr.dtype.element_ty),  # nearest even, the interpreter too
        mask=ok[:, None] & n_ok[None, :],
    )


def _gemm(a, w, scale, bias, weights, sorted_slots, experts, num_slots, top_k, first: bool) -> torch.Tensor:
    mxfp4 = w.dtype == torch.uint8
    e, n, k = *w.shape[:2], mxfp4_k(w) if mxfp4 else w.shape[2]
    if mxfp4:
        assert scale is not None and scale.shape == (e, n, k // 32) and scale.stride(2) == 1, (w.shape, scale)
    if bias is not None:
        assert bias.shape == (e, n), (bias.shape, w.shape)
        bias = bias.contiguous()
    out = torch.empty((num_slots, n), dtype=a.dtype, device=a.device)
    native = native_dot_for(a)
    cfg = tiles(sorted_slots.numel() // experts.numel(), n, k, native)  # the block moe_align padded the runs to
    grid = (experts.numel(), cdiv(n, cfg["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        scale if scale is not None else a,
        bias if bias is not None else a,
        weights if weights is not None else a,
        sorted_slots,
        experts,
        num_slots,
        n,
        k,
        top_k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        scale.stride(0) if scale is not None else 0,
        scale.stride(1) if mxfp4 else 0,
        bias.stride(0) if bias is not None else 0,
        FIRST=first,
        MUL_WEIGHT=weights is not None,
        HAS_SCALE=scale is not None and not mxfp4,
        MXFP4=mxfp4,
        HAS_BIAS=bias is not None,
        NATIVE_DOT=native,
        **cfg,
    )
    return out


@triton_op(
    "fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, bool gelu=False, "
    "Tensor? w13_scale=None, Tensor? w2_scale=None, Tensor? w13_bias=None, Tensor? w2_bias=None, "
    "float[]? swiglu=None) -> Tensor",
    lambda x, *args, **kwargs: torch.empty_like(x),
)
def fused_moe_triton(x, w13, w2, topk_weights, topk_ids, gelu=False, w13_scale=None, w2_scale=None, w13_bias=None,
                     w2_bias=None, swiglu=None):  # fmt: skip
    t, h = x.shape
    top_k = topk_ids.shape[1]
    k13, k2 = (mxfp4_k(w13), mxfp4_k(w2)) if w13.dtype == torch.uint8 else (w13.shape[2], w2.shape[2])
    assert k13 == h and w2.shape[1] == h and w13.shape[1] == 2 * k2, (w13.shape, w2.shape)
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    if t == 0:
        return torch.empty_like(x)
    s = t * top_k
    sorted_slots, experts = moe_align(topk_ids, w13.shape[0], block_size_for(s, w13.shape[0]))
    inter = _gemm(x, w13, w13_scale, w13_bias, None, sorted_slots, experts, s, top_k, first=True)  # [S, 2I]
    act = _act(inter, gelu, swiglu)  # [S, I]
    weights = topk_weights.to(torch.float32).flatten().contiguous()
    out = _gemm(act, w2, w2_scale, w2_bias, weights, sorted_slots, experts, s, top_k, first=False)  # [S, H]
    return out.view(t, top_k, h).float().sum(1).to(x.dtype)


def _act(h: torch.Tensor, gelu: bool, swiglu) -> torch.Tensor:
    assert not (gelu and swiglu is not None), "gelu and swiglu select different activations"
    if swiglu is not None:
        return swiglu_oai_and_mul(h, *swiglu)
    return gelu_tanh_and_mul(h) if gelu else silu_and_mul(h)


def _dequant(w: torch.Tensor, scale: torch.Tensor | None, dtype) -> torch.Tensor:
    if w.dtype == torch.uint8:  # MXFP4
        return dequantize_mxfp4_ref(w, scale, dtype)
    return w if scale is None else (w.float() * scale).to(dtype)


def _row(t: torch.Tensor | None, e: int, dtype=None) -> torch.Tensor | None:
    return None if t is None else t[e] if dtype is None else t[e].to(dtype)


def fused_moe_ref(x, w13, w2, topk_weights, topk_ids, gelu=False, w13_scale=None, w2_scale=None, w13_bias=None,
                  w2_bias=None, swiglu=None):  # fmt: skip
    """One matmul pair per expert that has tokens, over its gathered tokens; weighted rows summed per token."""
    t, h = x.shape
    out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        tok, k = torch.nonzero(topk_ids == e, as_tuple=True)
        w_e = _dequant(w13[e], _row(w13_scale, e), x.dtype)
        d_e = _dequant(w2[e], _row(w2_scale, e), x.dtype)
        a = _act(F.linear(x[tok], w_e, _row(w13_bias, e, x.dtype)), gelu, swiglu)  # [n, I]
        y = F.linear(a, d_e, _row(w2_bias, e, x.dtype))  # [n, H]
        out.index_add_(0, tok, (y * topk_weights[tok, k, None].to(y.dtype)).float())
    return out.to(x.dtype)


def fused_moe(x, w13, w2, topk_weights, topk_ids, gelu=False, w13_scale=None, w2_scale=None, w13_bias=None,
              w2_bias=None, swiglu=None) -> torch.Tensor:  # fmt: skip
    """[T, H] (see module doc); fp8 weights (e4m3) with per-expert [E, N, 1] fp32 scales, or MXFP4 ones (uint8
    w13 [E, 2I, H // 2], w2 [E, H, I // 2]) with their e8m0 scales (uint8 [E, 2I, H // 32], [E, H, I // 32]);
    per-expert biases w13_bias [E, 2I], w2_bias [E, H]; swiglu (alpha, limit): GPT-OSS's clamped SwiGLU for SiLU."""
    fn = fused_moe_triton if use_triton(x) else fused_moe_ref
    if w13.dtype == torch.uint8 or w13.dtype == FP8 and fn is fused_moe_ref:
        assert w13_scale is not None and w2_scale is not None, f"{w13.dtype} expert weights need their scales"
    if swiglu is not None:
        swiglu = [float(v) for v in swiglu]  # the operator's float[]
    return fn(x, w13, w2, topk_weights, topk_ids, gelu, w13_scale, w2_scale, w13_bias, w2_bias, swiglu)
