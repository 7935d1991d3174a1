"""Block-scaled FP8 (HF's fine-grained fp8: Qwen3-FP8, DeepSeek): W8A8 with one weight scale per [bn, bk] block
and one activation scale per token per bk columns. Triton kernels, launchers and torch references.

- `quant_token_groups(x, bk)` (the Triton op and its `_ref`): x [M, K] -> xq [M, K] e4m3, scales [M, ceil(K / bk)]
  fp32 (max |x| / 448 per token per group, >= 1e-12), the values rounded onto the e4m3 grid by kernels/fp8.py's
  rule.
- `fp8_block_linear(x, wq, w_scale, block, bias)`: y = sum over K blocks of (xq_b @ wq_b.T) * x_scale[:, b] *
  w_scale[n // bn, b]. The GEMM (vLLM's w8a8_block_fp8_matmul shape): a K tile never crosses a block, so each
  tile's fp32 partial product takes both scales before it is added. On a GPU tl.dot takes the fp8 operands (the
  first version widened them to fp32 first, a TF32 GEMM: 0.17-0.19x of bf16 at M=4096 on the H200, docs/gpu.md);
  under the interpreter it takes them widened, which is exact.
  torch 2.13's _scaled_mm also takes this recipe (its meta registration accepts BlockWise1x128 activations with
  BlockWise128x128 weights, served by cuBLASLt from CUDA 12.9 on Hopper-class GPUs). It is not used: this kernel
  also runs on sm89 (L4, L40S) and for any block shape, and it is the one path tested; timing the two against each
  other is for a GPU session (bench/kernel_bench.py has this kernel's rows)."""

from __future__ import annotations

import torch

from kernels._common import FP8, FP8_MAX, cdiv, gpu_facts, jit, next_power_of_2, tl, use_triton
from kernels._library import triton_op
from kernels.fp8 import MIN_SCALE, fp8e4m3_rne


@jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_s, K, GROUP, BLOCK: tl.constexpr):
    # grid (M, ceil(K / GROUP)); BLOCK >= GROUP
    row, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    m = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), 448.0), 1e-12)
    tl.store(s_ptr + row * stride_s + g, scale)
    q = fp8e4m3_rne(tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0))
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=m)


@triton_op(
    "quant_token_groups(Tensor x, int group) -> (Tensor, Tensor)",
    lambda x, group: (
        x.new_empty(x.shape, dtype=FP8),
        x.new_empty((x.shape[0], cdiv(x.shape[1], group)), dtype=torch.float32),
    ),  # fmt: skip
)
def quant_token_groups_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    assert x.stride(-1) == 1, "last dim must be contiguous"
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, cdiv(k, group)), dtype=torch.float32, device=x.device)
    if m and k:
        _quant_groups_kernel[(m, cdiv(k, group))](x, q, s, x.stride(0), q.stride(0), s.stride(0), k, group,
                                                  BLOCK=next_power_of_2(group))  # fmt: skip
    return q, s


def quant_token_groups_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    xf = torch.nn.functional.pad(x.float(), (0, (-k) % group)).reshape(m, -1, group)  # [M, G, group]
    amax = xf.abs().amax(-1, keepdim=True)  # over a tensor: CUDA divides by a Python number as x * (1 / 448)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(m, -1)[:, :k]
    return q, scale.squeeze(-1)


@jit
def _block_gemm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, c_ptr,
    M, N, K, BN, BK,
    stride_am, stride_bn, stride_sam, stride_sbn, stride_cm,
    HAS_BIAS: tl.constexpr, NATIVE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # c[M, N] = sum_k (a[M, k] * sa[M, k // BK]) (b[N, k] * sb[N // BN, k // BK]); BK a multiple of BLOCK_K, so each
    # step's partial sum lies in one scale block and is scaled into the fp32 accumulator (on Hopper also the
    # promotion that its fp8 tensor cores' shorter accumulator needs every 128 of K)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn
    sb_rows = sb_ptr + (rn // BN).to(tl.int64) * stride_sbn  # [BLOCK_N]: each column's weight-block row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_cols + kk[:, None], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        kb = k0 // BK
        sa = tl.load(sa_ptr + rm.to(tl.int64) * stride_sam + kb, mask=rm < M, other=0.0)  # [BLOCK_M]
        sb = tl.load(sb_rows + kb, mask=rn < N, other=0.0)  # [BLOCK_N]
        if NATIVE_DOT:  # a GPU (sm89+: the engine runs fp8 nowhere else): the fp8 tensor cores
            part = tl.dot(a, b)
        else:  # the interpreter, whose low-precision tl.dot is wrong: fp8 -> fp32 is exact, and so are the products
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        acc += part * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton_op(
    "fp8_block_gemm(Tensor xq, Tensor x_scale, Tensor wq, Tensor w_scale, int bn, int bk, Tensor? bias, "
    "ScalarType out_dtype) -> Tensor",
    lambda xq, x_scale, wq, w_scale, bn, bk, bias, out_dtype: xq.new_empty(
        (xq.shape[0], wq.shape[0]), dtype=out_dtype
    ),  # fmt: skip
)
def fp8_block_gemm_triton(xq, x_scale, wq, w_scale, bn: int, bk: int, bias, out_dtype) -> torch.Tensor:
    """xq [M, K] fp8, x_scale [M, ceil(K/bk)], wq [N, K] fp8, w_scale [ceil(N/bn), ceil(K/bk)] -> [M, N]."""
    m, k = xq.shape
    n = wq.shape[0]
    assert xq.dtype == FP8 and wq.dtype == FP8 and wq.shape[1] == k, (xq.dtype, wq.dtype, tuple(wq.shape))
    assert w_scale.shape == (cdiv(n, bn), cdiv(k, bk)) and x_scale.shape == (m, cdiv(k, bk)), (w_scale.shape, bk)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    bm = min(64, max(16, next_power_of_2(m)))  # vLLM's block-fp8 tiles: 64 x 128, 128 of K (a scale block)
    bnn = min(128, max(16, next_power_of_2(n)))
    bkk = min(128, bk)
    assert bk % bkk == 0 and bkk >= 16, f"block width {bk} must be a multiple of 16"
    grid = (cdiv(m, bm), cdiv(n, bnn))
    _block_gemm_kernel[grid](
        xq, wq, x_scale, w_scale, bias if bias is not None else x_scale, out,
        m, n, k, bn, bk,
        xq.stride(0), wq.stride(0), x_scale.stride(0), w_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, NATIVE_DOT=gpu_facts(xq) is not None, BLOCK_M=bm, BLOCK_N=bnn, BLOCK_K=bkk,
    )  # fmt: skip
    return out


def fp8_block_linear_ref(x, wq, w_scale, block: tuple[int, int], bias=None, out_dtype=None) -> torch.Tensor:
    """x [..., K] -> [..., N]: activations quantized per token group, both sides dequantized, one fp32 matmul (the
    scales factor out of each block's sum, so this is the kernel's arithmetic up to fp32 rounding order)."""
    bn, bk = block
    k, n = x.shape[-1], wq.shape[0]
    xq, xs = quant_token_groups_ref(x.reshape(-1, k), bk)
    xd = xq.float() * xs.repeat_interleave(bk, 1)[:, :k]
    wd = wq.float() * w_scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    y = xd @ wd.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], n)


def fp8_block_linear(x, wq, w_scale, block: tuple[int, int], bias=None, out_dtype=None) -> torch.Tensor:
    """W8A8 with block scales: the Triton kernels on CUDA (or when forced), else the reference."""
    if not use_triton(x):
        return fp8_block_linear_ref(x, wq, w_scale, block, bias, out_dtype)
    k, n = x.shape[-1], wq.shape[0]
    xq, xs = quant_token_groups_triton(x.reshape(-1, k).contiguous(), block[1])
    y = fp8_block_gemm_triton(xq, xs, wq, w_scale, block[0], block[1], bias, out_dtype or x.dtype)
    return y.reshape(*x.shape[:-1], n)
