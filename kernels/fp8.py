"""FP8 (e4m3) quantization and the W8A8 linear: Triton kernels, launchers and torch references.

- `quant_per_token(x)`: dynamic per-row activation quant, scale = max|row| / 448 (>= 1e-12 so zero rows work),
  xq = (x / scale).clamp(-448, 448) in float8_e4m3fn. One program per row.
- `quant_per_channel(w)`: the same rule per output channel of a weight [N, K] (done once, at load).
- `fp8_linear(x, wq, w_scale, bias)`: quantize x per token, then on CUDA sm89+ `torch._scaled_mm` with rowwise
  scales; elsewhere a Triton GEMM that reads fp8 tiles, widens them to fp32 and applies both scales after the
  K loop (fp8 values are exact in fp32 and in tf32, so tl.dot's products are exact even with tf32).

Rounding: every kernel that writes fp8 first rounds the fp32 value onto the e4m3 grid itself (round to nearest
even, `fp8e4m3_rne`), so the final cast has nothing left to round. The cast then gives torch's bits on a GPU and
in the Triton interpreter alike; the interpreter's own fp32->fp8 cast rounds ties up and, when the mantissa carry
crosses a binade with an odd exponent, returns half the value (127.8 -> 64 instead of 128).
"""

from __future__ import annotations

import functools

import torch

from kernels._common import FP8, FP8_MAX, cdiv, gpu_facts, jit, next_power_of_2, tl, use_triton
from kernels._library import triton_op

MIN_SCALE = 1e-12  # floor of dynamic scales: an all-zero row quantizes to zeros instead of NaN


@jit
def fp8e4m3_rne(v):
    """fp32 -> fp32 value on the e4m3 grid, round to nearest even; |v| must already be <= 448."""
    # Normal range (|v| >= 2^-6): keep 3 of fp32's 23 mantissa bits, RNE on the integer pattern; a carry out of
    # the mantissa correctly bumps the exponent.
    bits = v.to(tl.uint32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Subnormal range (|v| < 2^-6): a fixed grid of 2^-9. fp32's ulp at 2^14 is 2^-9, so adding 2^14 rounds
    # |v| to that grid in one RNE step, and subtracting it back is exact.
    # The sign bit is copied back so that -0 and tiny negatives give -0, as torch's cast does.
    a = tl.abs(v)
    sub = ((a + 16384.0) - 16384.0).to(tl.uint32, bitcast=True) | (bits & 0x80000000)
    return tl.where(a < 0.015625, sub.to(tl.float32, bitcast=True), normal)


# ----------------------------------------------------------------------------------------------------------
# quant_per_token / quant_per_channel: one program per row


@jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, K, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # pass 1: max |x| of the row
        m = k0 + cols < K
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), 448.0), 1e-12)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):  # pass 2: scale, clamp, round, store
        m = k0 + cols < K
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=m, other=0.0).to(tl.float32)
        q = fp8e4m3_rne(tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0))
        tl.store(q_ptr + row * stride_q + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=m)


@triton_op(
    "quant_rows(Tensor x) -> (Tensor, Tensor)",
    lambda x: (x.new_empty(x.shape, dtype=FP8), x.new_empty((x.shape[0], 1), dtype=torch.float32)),
)
def quant_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32/fp16/bf16, last dim contiguous) -> (q [M, K] fp8, scale [M, 1] fp32)."""
    assert x.dim() == 2, f"expected [M, K], got {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    assert x.stride(-1) == 1, "last dim must be contiguous"
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m > 0 and k > 0:
        _quant_rows_kernel[(m,)](x, q, s, x.stride(0), q.stride(0), k, BLOCK_K=min(next_power_of_2(k), 1024))
    return q, s


def quant_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()  # [M, K]
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)  # [M, 1]
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


quant_per_token_ref = quant_rows_ref
quant_per_channel_ref = quant_rows_ref


def quant_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quant. x [T, K] -> (xq [T, K] float8_e4m3fn, scale [T, 1] fp32); x ~= xq * scale."""
    return quant_rows_triton(x) if use_triton(x) else quant_rows_ref(x)


def quant_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight quant per output channel, once at load. w [N, K] -> (wq [N, K] fp8, scale [N, 1] fp32)."""
    return quant_rows_triton(w) if use_triton(w) else quant_rows_ref(w)


# ----------------------------------------------------------------------------------------------------------
# fp8_linear


@jit
def _fp8_gemm_kernel(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # c[M, N] = (a[M, K] @ b[N, K].T) * sa[M] * sb[N] + bias[N]; a, b fp8 with contiguous K.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rk = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am  # [BLOCK_M, 1]
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_cols + kk[:, None], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        # fp8 -> fp32 is exact; fp32 operands also dodge the interpreter's broken low-precision tl.dot
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
    sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)  # [BLOCK_M]
    sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)  # [BLOCK_N]
    acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton_op(
    "fp8_gemm(Tensor xq, Tensor x_scale, Tensor wq, Tensor w_scale, Tensor? bias, ScalarType out_dtype) -> Tensor",
    lambda xq, x_scale, wq, w_scale, bias, out_dtype: xq.new_empty((xq.shape[0], wq.shape[0]), dtype=out_dtype),
)
def fp8_gemm_triton(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """xq [M, K] fp8, x_scale [M, 1] fp32, wq [N, K] fp8, w_scale [N, 1] fp32, bias [N] -> [M, N]."""
    m, k = xq.shape
    n = wq.shape[0]
    _check_operands(xq, x_scale, wq, w_scale, bias)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
    bm = min(64, max(16, next_power_of_2(m)))  # tl.dot wants every block dim >= 16
    bn = min(64, max(16, next_power_of_2(n)))
    bk = min(64, max(16, next_power_of_2(k)))
    grid = (cdiv(m, bm), cdiv(n, bn))
    _fp8_gemm_kernel[grid](
        xq,
        wq,
        x_scale,
        w_scale,
        bias if bias is not None else x_scale,
        out,
        m,
        n,
        k,
        xq.stride(0),
        wq.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return out


def _check_operands(xq, x_scale, wq, w_scale, bias) -> None:
    m, k = xq.shape
    n = wq.shape[0]
    assert xq.dtype == FP8 and wq.dtype == FP8, (xq.dtype, wq.dtype)
    assert wq.shape == (n, k), f"wq {tuple(wq.shape)} vs x [.., {k}]"
    assert xq.stride(-1) == 1 and wq.stride(-1) == 1, "K must be contiguous"
    assert x_scale.shape == (m, 1) and x_scale.dtype == torch.float32 and x_scale.is_contiguous()
    assert w_scale.shape == (n, 1) and w_scale.dtype == torch.float32 and w_scale.is_contiguous(), (
        f"w_scale must be [N, 1] fp32, got {tuple(w_scale.shape)} {w_scale.dtype}"
    )
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), "bias must be [N] contiguous"


def scaled_mm_supported(x: torch.Tensor, n: int, k: int) -> bool:
    """torch._scaled_mm with rowwise scales: CUDA sm89+, and K and N multiples of 16. A CUDA tensor, not only a
    GPU's facts: under bench/compile_arch.py's stand-in (CPU tensors, an sm89+ target) cuBLASLt cannot be asked,
    and the Triton GEMM, this path's only kernel of ours, is the one to compile."""
    return x.is_cuda and k % 16 == 0 and n % 16 == 0 and gpu_facts(x).capability >= (8, 9)


def scaled_mm_out_dtype(out_dtype: torch.dtype, capability: tuple[int, int] | None, cuda: str | None) -> torch.dtype:
    """What _scaled_mm can write for `out_dtype` (torch's ScaledBlas.cpp): cuBLASLt's rowwise path (sm90, CUDA
    12.9+) writes fp16 as well; CUTLASS's (sm89, sm100+, older CUDA) and the CPU build write only bf16, so there fp16
    is rounded twice (bf16, then fp16: about 3 mantissa bits lost). `capability` None: not CUDA."""
    if out_dtype == torch.float16 and capability is not None and capability[0] == 9 and cuda:
        if tuple(int(v) for v in cuda.split(".")[:2]) >= (12, 9):
            return torch.float16
    return torch.bfloat16


@functools.cache
def _gemm_dtype(out_dtype: torch.dtype, capability: tuple[int, int] | None) -> torch.dtype:
    """scaled_mm_out_dtype for this torch build, worked out once per (dtype, GPU) rather than per linear."""
    return scaled_mm_out_dtype(out_dtype, capability, torch.version.cuda)


def fp8_gemm_scaled_mm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """torch._scaled_mm, rowwise: mat1 [M, K] row-major, mat2 [K, N] column-major (wq.t() of a row-major
    [N, K]), scale_a [M, 1] and scale_b [1, N] fp32. The GEMM writes out_dtype when it can (scaled_mm_out_dtype),
    else bf16; the bias is fused when the GEMM writes out_dtype itself."""
    _check_operands(xq, x_scale, wq, w_scale, bias)
    gemm_dtype = _gemm_dtype(out_dtype, gpu_facts(xq).capability if xq.is_cuda else None)  # CPU _scaled_mm: bf16
    fuse_bias = bias is not None and out_dtype == gemm_dtype
    out = torch._scaled_mm(
        xq,
        wq.t(),
        scale_a=x_scale,
        scale_b=w_scale.t(),
        bias=bias.to(gemm_dtype) if fuse_bias else None,
        out_dtype=gemm_dtype,
    )
    if bias is not None and not fuse_bias:
        return (out.float() + bias.float()).to(out_dtype)
    return out.to(out_dtype)


def quant_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's static activation scale [1]: x [T, K] -> (xq fp8, the scale as [T, 1]). Torch ops on the
    device (no host sync); the cast rounds to nearest even as the per-token kernel's does."""
    xq = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return xq, scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()


def fp8_linear_ref(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp8 products accumulated in fp32, then scaled per token and per channel, as the GEMM kernels do
    (and cheaper on CPU than dequantizing the weights first). x [..., K], wq [N, K], w_scale [N, 1] -> [..., N].
    x_scale: a static activation scale [1] (None: dynamic, per token)."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quant_rows_ref(x2) if x_scale is None else quant_static(x2, x_scale)  # [T, K], [T, 1]
    y = (xq.float() @ wq.float().t()) * x_scale * w_scale.t()  # [T, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], wq.shape[0])


def fp8_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8 linear: x [..., K] (quantized here, per token, or with the static scale x_scale [1]), wq [N, K] fp8,
    w_scale [N, 1] fp32 -> [..., N]."""
    if not use_triton(x):
        return fp8_linear_ref(x, wq, w_scale, bias, out_dtype, x_scale)
    k = x.shape[-1]
    n = wq.shape[0]
    x2 = x.reshape(-1, k)
    xq, x_scale = quant_rows_triton(x2) if x_scale is None else quant_static(x2, x_scale)  # [T, K] fp8, [T, 1]
    gemm = fp8_gemm_scaled_mm if scaled_mm_supported(x, n, k) else fp8_gemm_triton
    return gemm(xq, x_scale, wq, w_scale, bias, out_dtype or x.dtype).reshape(*x.shape[:-1], n)
