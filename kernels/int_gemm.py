"""Weight-only integer linears (W4A16, W8A16): the GPTQ / AWQ / compressed-tensors checkpoints after
engine/quant/int_weights.py has put them in one layout, the dequantizing Triton GEMM, and its torch reference.

The layout (every format converts to it once, at load):
- `qweight` int32 [N, ceil(K / P)], P = 32 // bits values per word packed along K in natural order (value k of a row
  at bits (k % P) * bits of word k // P), unsigned: 0 .. 2^bits - 1;
- `scales` [N, G] (16-bit or fp32: the kernel widens them), G = ceil(K / group) groups along K (group = K: one per
  output channel);
- `zeros` uint8 [N, G], the unsigned zero point, or None: symmetric, zero point 2^(bits - 1);
- `perm` int64 [K] or None: act-order (GPTQ's desc_act). The stored columns are the input channels in `perm`'s
  order, sorted by group, so groups are contiguous again; the activations are gathered by `perm` first.

  w[n, j] = (q[n, j] - zero[n, j // group]) * scale[n, j // group];  y = x[:, perm] @ w.T

`int_linear` runs the Triton kernel on CUDA tensors (the tile's weights dequantized in the main loop, fp32
accumulation) and, for small M, splits K over programs whose partial sums are added after. The weights come in as
whole packed words, a tile contiguous along K, and are unpacked in registers: the first version loaded a word per
weight (each word PER times, neighbouring lanes a row apart), and ran at 0.05x of bf16 on an H200 (docs/gpu.md).
Elsewhere it runs `int_linear_ref`, which dequantizes the whole weight per call (engine/quant/int_weights.py keeps
CPU models dequantized at load instead: see docs/decisions.md)."""

from __future__ import annotations

import torch

from kernels._common import cdiv, gpu_facts, jit, native_dot_for, next_power_of_2, round_to, tl, use_triton
from kernels._library import triton_op


def unpack(qweight: torch.Tensor, bits: int, k: int | None = None, order=None) -> torch.Tensor:
    """int32 [N, ceil(K / P)] -> the unsigned values int32 [N, K] (all P per word when k is None). order: the
    column of its P that each of a word's values holds (AWQ's interleave), natural by default."""
    per = 32 // bits
    shifts = torch.arange(per, device=qweight.device, dtype=torch.int32) * bits  # [P]
    vals = (qweight.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [N, W, P]; >> of a negative word is arithmetic
    if order is not None:
        vals = vals[..., [order.index(j) for j in range(per)]]
    return vals.reshape(qweight.shape[0], -1)[:, :k]


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse: unsigned values [N, K] -> int32 [N, ceil(K / P)] (zero-padded)."""
    per = 32 // bits
    n, k = values.shape
    v = torch.nn.functional.pad(values.to(torch.int64), (0, (-k) % per)).reshape(n, -1, per)
    shifts = torch.arange(per, device=values.device, dtype=torch.int64) * bits
    words = (v << shifts).sum(-1)  # < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize(qweight, scales, zeros, bits: int, group: int, k: int, dtype=None) -> torch.Tensor:
    """[N, K] in `dtype` (default scales'), in the stored (perm) column order; products in fp32, rounded once."""
    g = torch.arange(k, device=qweight.device) // group  # [K]: each column's group
    z = (1 << (bits - 1)) if zeros is None else zeros.to(torch.int32)[:, g]
    return ((unpack(qweight, bits, k) - z).to(torch.float32) * scales.float()[:, g]).to(dtype or scales.dtype)


def int_linear_ref(x, qweight, scales, zeros, perm, bits: int, group: int, bias=None) -> torch.Tensor:
    """x [..., K] -> [..., N] through the dequantized weight (fp32 products when x is fp32)."""
    k = x.shape[-1]
    if perm is not None:
        x = x[..., perm]
    w = dequantize(qweight, scales, zeros, bits, group, k, x.dtype)
    return torch.nn.functional.linear(x, w, bias)


@jit
def _int_gemm_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K, GROUP, K_PER_SPLIT,
    stride_xm, stride_qn, stride_sn, stride_om, stride_os,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, NATIVE_DOT: tl.constexpr,
    ONE_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # out[split, M, N] (fp32 partials when split; else the output) = x[M, K-range] @ dequant(q)[N, K-range].T
    # The weights come in as a [BLOCK_K / PER, BLOCK_N] tile of whole words, each column's contiguous along K (whole
    # sectors, each word read once), unpacked in registers. k0 is a multiple of PER (BLOCK_K and K_PER_SPLIT are).
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, WORDS)
    nmask = rn < N
    shift = (rk % PER) * BITS  # [BLOCK_K]: value k of a word sits at bits (k % PER) * BITS
    k_lo = split * K_PER_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        kk = k0 + rk  # [BLOCK_K]
        km = kk < K
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & km[None, :], other=0.0)  # fmt: skip
        wi = k0 // PER + rw  # [WORDS]
        words = tl.load(
            q_ptr + rn.to(tl.int64)[None, :] * stride_qn + wi[:, None],
            mask=nmask[None, :] & (wi * PER < K)[:, None],
            other=0,
        )  # [WORDS, BLOCK_N]
        # each word PER times down the tile: row k holds word k // PER (the values past K meet x's zeros)
        words = tl.reshape(tl.broadcast_to(words[:, None, :], (WORDS, PER, BLOCK_N)), (BLOCK_K, BLOCK_N))
        q = (words >> shift[:, None]) & ((1 << BITS) - 1)  # [BLOCK_K, BLOCK_N] unsigned
        if ONE_GROUP:  # the tile lies in one group (GROUP a multiple of BLOCK_K): a scale per column
            g = k0 // GROUP
            s = tl.load(s_ptr + rn.to(tl.int64) * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)[None, :]
            if HAS_ZEROS:
                z = tl.load(z_ptr + rn.to(tl.int64) * stride_sn + g, mask=nmask, other=0).to(tl.int32)[None, :]
            else:
                z = 1 << (BITS - 1)
        else:
            sm = nmask[None, :] & km[:, None]
            sp = rn.to(tl.int64)[None, :] * stride_sn + (kk // GROUP)[:, None]
            s = tl.load(s_ptr + sp, mask=sm, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(z_ptr + sp, mask=sm, other=0).to(tl.int32)
            else:
                z = 1 << (BITS - 1)
        w = (q - z).to(tl.float32) * s  # [BLOCK_K, BLOCK_N]
        if NATIVE_DOT:  # tensor cores take the 16-bit operands (the weights rounded to x's dtype, as the reference)
            acc += tl.dot(x, w.to(x.dtype))
        else:
            acc += tl.dot(x.to(tl.float32), round_to(w, x_ptr.dtype.element_ty), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.where(split == 0, tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32), 0.0)[None, :]
    o = out_ptr + split.to(tl.int64) * stride_os + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _fake(x, qweight, scales, zeros, perm, bits, group, bias, split_k):
    return x.new_empty((x.shape[0], qweight.shape[0]))


@triton_op(
    "int_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? perm, int bits, int group, "
    "Tensor? bias, int split_k) -> Tensor",
    _fake,
)
def int_gemm_triton(x, qweight, scales, zeros, perm, bits: int, group: int, bias, split_k: int) -> torch.Tensor:
    """x [M, K] 16-bit or fp32 (contiguous K) -> [M, N] in x's dtype. split_k > 1: K in that many ranges, their
    fp32 partial sums added after (small M: more programs than M x N tiles give)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.dtype == torch.int32 and bits in (4, 8) and scales.shape[0] == n, (qweight.dtype, bits)
    assert zeros is None or zeros.shape == scales.shape
    if perm is not None:
        x = x.index_select(1, perm)
    x = x.contiguous()
    bm = min(64, max(16, next_power_of_2(m)))
    bn = min(64, max(16, next_power_of_2(n)))
    bk = min(64, max(16, next_power_of_2(k)))
    per_split = cdiv(cdiv(k, split_k), bk) * bk  # whole K blocks per range
    splits = cdiv(k, per_split)
    out = torch.empty((splits, m, n), dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    if m and n:
        grid = (cdiv(m, bm), cdiv(n, bn), splits)
        _int_gemm_kernel[grid](
            x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, out,
            m, n, k, group, per_split,
            x.stride(0), qweight.stride(0), scales.stride(0), out.stride(1), out.stride(0),
            BITS=bits, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, NATIVE_DOT=native_dot_for(x),
            ONE_GROUP=group % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        )  # fmt: skip
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)


def split_k_for(x: torch.Tensor, m: int, n: int, k: int) -> int:
    """Small M (decode): too few M x N tiles to fill the GPU, so K is split until about one program per SM."""
    facts = gpu_facts(x)
    tiles = cdiv(m, 64) * cdiv(n, 64)
    if facts is None or m > 64 or tiles >= facts.sms:
        return 1
    return max(1, min(cdiv(facts.sms, tiles), cdiv(k, 256)))


def int_linear(x, qweight, scales, zeros, perm, bits: int, group: int, bias=None) -> torch.Tensor:
    """x [..., K] -> [..., N]: the Triton GEMM on CUDA (or when forced), else the reference."""
    if not use_triton(x):
        return int_linear_ref(x, qweight, scales, zeros, perm, bits, group, bias)
    k, n = x.shape[-1], qweight.shape[0]
    x2 = x.reshape(-1, k)
    y = int_gemm_triton(x2, qweight, scales, zeros, perm, bits, group, bias, split_k_for(x, x2.shape[0], n, k))
    return y.reshape(*x.shape[:-1], n)
