"""KV cache write (kernels/cache_write.py) and FP8 quant / W8A8 linear (kernels/fp8.py) against their torch
references, run through the Triton interpreter (conftest forces the Triton backend), or on DEVICE for real.
Inputs are drawn on CPU, then moved to DEVICE.

FP8 writes: the interpreter's own fp32->fp8 cast mis-rounds (ties go up, and a mantissa carry into an odd
exponent halves the value: 127.8 -> 64). The kernels therefore round onto the e4m3 grid themselves before the
cast, so their fp8 bytes must equal torch's exactly, here and on a GPU; `test_fp8_rounding_grid` pins that down
on every tie of the format. Where exactness is not the point, `assert_fp8_close` bounds one e4m3 step.
"""

import pytest
import torch

from kernels.cache_write import reshape_and_cache, reshape_and_cache_ref
from kernels.fp8 import (
    FP8,
    fp8_gemm_scaled_mm,
    fp8_linear,
    fp8_linear_ref,
    quant_per_channel,
    quant_per_channel_ref,
    quant_per_token,
    quant_per_token_ref,
    scaled_mm_out_dtype,
)
from tests.kernels.conftest import DEVICE, assert_close, to_device

FP8_NAN = 0x7F  # e4m3fn byte pattern of NaN


def assert_fp8_equal(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Same bytes (NaN == NaN)."""
    bad = (actual.view(torch.uint8) != expected.view(torch.uint8)).nonzero()
    a, b = actual.float(), expected.float()
    if len(bad):
        idx = bad[:8].tolist()
        detail = ", ".join(f"{tuple(i)}: {a[tuple(i)].item():.6g} vs {b[tuple(i)].item():.6g}" for i in idx)
        raise AssertionError(f"{name}: {len(bad)} fp8 mismatches, first {detail}")


def assert_fp8_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Within one e4m3 step: a step is at most 2^-3 of the value (3-bit mantissa), 2^-9 among subnormals."""
    a, b = actual.float(), expected.float()
    bad = ~(((a - b).abs() <= 2.0**-3 * b.abs() + 2.0**-9) | (a.isnan() & b.isnan()))  # NaN: unwritten
    if bad.any():
        idx = bad.nonzero()[:8].tolist()
        detail = ", ".join(f"{tuple(i)}: {a[tuple(i)].item():.6g} vs {b[tuple(i)].item():.6g}" for i in idx)
        raise AssertionError(f"{name}: {int(bad.sum())} beyond one fp8 step, first {detail}")


# ---------------------------------------------------------------------------------------------------------
# reshape_and_cache


def _poisoned_cache(kvh, num_blocks, block_size, d, dtype):
    """[KVH, num_blocks, block_size, D] of NaN, on DEVICE."""
    if dtype == FP8:
        return torch.full((kvh, num_blocks, block_size, d), FP8_NAN, dtype=torch.uint8, device=DEVICE).view(FP8)
    return torch.full((kvh, num_blocks, block_size, d), float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("kvh,d", [(1, 64), (2, 128), (3, 48)])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, FP8])
def test_reshape_and_cache(kvh, d, cache_dtype):
    g = torch.Generator().manual_seed(100 * kvh + d + (7 if cache_dtype == FP8 else 0))
    block_size, num_blocks, t = 4, 6, 7  # T not a multiple of block_size
    in_dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    k = (torch.randn(t, kvh, d, generator=g) * 2).to(in_dtype)  # [T, KVH, D]
    v = (torch.randn(t, kvh, d, generator=g) * 2).to(in_dtype)
    # tokens start mid-block: block 3 from offset 2, then block 0, then block 5 (a block table [3, 0, 5])
    blocks = [3, 3, 0, 0, 0, 0, 5]
    offsets = [2, 3, 0, 1, 2, 3, 0]
    slots = torch.tensor([b * block_size + o for b, o in zip(blocks, offsets)], dtype=torch.int64)
    slots[4] = -1  # a padding token writes nothing
    scales = {}
    if cache_dtype == FP8:
        k[0, 0, :4] = torch.tensor([100.0, -100.0, 1e-3, -3e-4])  # saturates at ±448 / lands among subnormals
        scales = dict(k_scale=torch.tensor(0.05, device=DEVICE), v_scale=torch.tensor([0.02], device=DEVICE))
    k, v, slots = to_device(k, v, slots)

    kc, vc = (_poisoned_cache(kvh, num_blocks, block_size, d, cache_dtype) for _ in range(2))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    reshape_and_cache(k, v, kc, vc, slots, **scales)
    reshape_and_cache_ref(k, v, kc_ref, vc_ref, slots, **scales)

    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)  # [num_blocks * block_size]
    written[slots[slots >= 0]] = True
    for name, got, ref in (("k_cache", kc, kc_ref), ("v_cache", vc, vc_ref)):
        changed = ~got.float().isnan().view(kvh, -1, d)  # [KVH, slots, D]
        assert torch.equal(changed, written[None, :, None].expand_as(changed)), (
            f"{name}: written slots {changed.any(-1).any(0).nonzero().flatten().tolist()}, "
            f"expected {written.nonzero().flatten().tolist()}"
        )
        if cache_dtype == FP8:
            assert_fp8_close(got, ref, name)
            assert_fp8_equal(got, ref, name)  # exact: the kernel rounds before the cast (module docstring)
        else:
            torch.testing.assert_close(got, ref, atol=0, rtol=0, equal_nan=True, msg=name)  # a copy: exact
    if cache_dtype == FP8:  # the saturated and subnormal values really occurred
        first = kc_ref[0, 3, 2, :4].float()  # token 0: block 3, offset 2
        assert first.tolist() == [448.0, -448.0, 0.01953125, -0.005859375], first.tolist()


def test_reshape_and_cache_rejects_fp8_without_scale():
    k = to_device(torch.randn(2, 1, 16))
    kc = to_device(torch.zeros(1, 2, 4, 16, dtype=FP8))
    with pytest.raises(AssertionError, match="k_scale"):
        reshape_and_cache(k, k, kc, kc.clone(), torch.tensor([0, 1], device=DEVICE))


# ---------------------------------------------------------------------------------------------------------
# quant_per_token / quant_per_channel


def test_fp8_rounding_grid():
    """Every e4m3 value, every midpoint between neighbours (ties to even) and points just off them, both
    signs, subnormals: with max 448 the row's scale is exactly 1, so xq is x rounded to fp8."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    mid = (grid[:-1] + grid[1:]) / 2
    vals = torch.cat(
        [
            torch.tensor([448.0]),
            grid,
            mid,
            mid.nextafter(torch.tensor(0.0)),
            mid.nextafter(torch.tensor(1e4)),
            torch.linspace(-0.02, 0.02, 81),
        ]
    )
    x = to_device(torch.cat([vals, -vals])[None])  # [1, K]
    xq, scale = quant_per_token(x)
    xq_ref, scale_ref = quant_per_token_ref(x)
    assert scale.item() == scale_ref.item() == 1.0
    assert_fp8_equal(xq, xq_ref, "xq")


def _assert_within_half_step(q, scale, x):
    """Round to nearest: |q * scale - x| <= half an e4m3 step (2^-4 |x|, or 2^-10 * scale among subnormals)."""
    err = (q.float() * scale - x.float()).abs()
    bound = 2.0**-4 * x.float().abs() + 2.0**-10 * scale
    assert torch.all(err <= bound), f"dequantization error {(err - bound).max().item():.3g} past half a step"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_per_token(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 96, generator=g) * torch.tensor([1.0, 1e-3, 30.0, 1.0, 5.0])[:, None]).to(dtype)
    x[3] = 0  # an all-zero row: scale floors at 1e-12, xq stays 0
    x = to_device(x)
    xq, scale = quant_per_token(x)
    xq_ref, scale_ref = quant_per_token_ref(x)
    assert xq.dtype == FP8 and xq.shape == x.shape and scale.dtype == torch.float32 and scale.shape == (5, 1)
    assert_close(scale, scale_ref, "scale", atol=0.0, rtol=1e-6)
    assert_fp8_close(xq, xq_ref, "xq")
    assert_fp8_equal(xq, xq_ref, "xq")
    assert torch.all(xq[3].float() == 0) and scale[3].item() == pytest.approx(1e-12)
    assert torch.all(xq.float().abs().amax(-1)[[0, 1, 2, 4]] == 448.0)  # each row's max maps to ±448
    _assert_within_half_step(xq, scale, x)


def test_quant_per_channel():
    g = torch.Generator().manual_seed(4)
    w = to_device(torch.randn(24, 40, generator=g, dtype=torch.float32) * 0.02)
    wq, scale = quant_per_channel(w)
    wq_ref, scale_ref = quant_per_channel_ref(w)
    assert wq.shape == (24, 40) and scale.shape == (24, 1)
    assert_close(scale, scale_ref, "scale", atol=0.0, rtol=1e-6)
    assert_fp8_equal(wq, wq_ref, "wq")
    _assert_within_half_step(wq, scale, w)


# ---------------------------------------------------------------------------------------------------------
# fp8_linear (W8A8)


def _w8a8_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> float:
    """Relative error of y against the unquantized float linear, over the whole output."""
    y_float = x.float() @ w.float().t() + bias.float()
    return ((y.float() - y_float).norm() / y_float.norm()).item()


def _linear_case(seed, t=7, k=64, n=48):
    """x [T, K], w [N, K], bias [N]: drawn on CPU, on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    return to_device(torch.randn(t, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g))


@pytest.fixture
def triton_gemm(monkeypatch):
    """fp8_linear through the Triton GEMM even where torch._scaled_mm would take over (CUDA sm89+, K and N
    multiples of 16): the tests using this check that kernel, whose fp32 output is tighter than _scaled_mm's
    bf16 one. On CPU this changes nothing; test_scaled_mm_path and test_fp8_linear_uses_scaled_mm_on_sm89
    cover the other path."""
    monkeypatch.setattr("kernels.fp8.scaled_mm_supported", lambda x, n, k: False)


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_linear_fp32(seed, triton_gemm):
    x, w, bias = _linear_case(seed)
    wq, w_scale = quant_per_channel(w)
    y = fp8_linear(x, wq, w_scale, bias)  # [T, N]
    assert y.shape == (7, 48) and y.dtype == torch.float32
    # the kernel applies both scales after the K loop, the reference before: only fp32 rounding differs
    assert_close(y, fp8_linear_ref(x, wq, w_scale, bias), "vs fp8_linear_ref", atol=1e-4, rtol=1e-5)
    # e4m3 keeps 3 mantissa bits: about 2-2.5 % rms error per operand, ~3.5 % on a product of random normals
    assert _w8a8_error(y, x, w, bias) < 0.05


def test_fp8_linear_bf16_odd_shapes(triton_gemm):
    """Odd T, K and N (masked tiles, K loop with a tail), bf16 in and out, no bias, leading dims."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 72, generator=g).to(torch.bfloat16)  # [B, S, K]
    w = torch.randn(33, 72, generator=g).to(torch.bfloat16)
    x, w = to_device(x, w)
    wq, w_scale = quant_per_channel(w)
    y = fp8_linear(x, wq, w_scale)
    assert y.shape == (2, 5, 33) and y.dtype == torch.bfloat16
    assert_close(y, fp8_linear_ref(x, wq, w_scale), "vs fp8_linear_ref")
    assert _w8a8_error(y, x, w, torch.zeros(33, device=DEVICE)) < 0.05
    y32 = fp8_linear(x, wq, w_scale, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert_close(y32, fp8_linear_ref(x, wq, w_scale, out_dtype=torch.float32), "fp32 out", atol=1e-4, rtol=1e-5)


def test_fp8_linear_detects_perturbed_weight(triton_gemm):
    """The W8A8 check must be able to fail: one perturbed output channel pushes the error past the bound."""
    x, w, bias = _linear_case(2)
    w_bad = w.clone()
    w_bad[5] += to_device(torch.randn(64, generator=torch.Generator().manual_seed(9)))
    wq_bad, s_bad = quant_per_channel(w_bad)
    y_bad = fp8_linear(x, wq_bad, s_bad, bias)
    assert _w8a8_error(y_bad, x, w, bias) > 0.05
    wq, w_scale = quant_per_channel(w)
    with pytest.raises(AssertionError):
        assert_close(y_bad, fp8_linear_ref(x, wq, w_scale, bias), "perturbed", atol=1e-4, rtol=1e-5)


def _sm89_or_newer() -> bool:
    return DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE) >= (8, 9)


@pytest.mark.skipif(
    DEVICE.type == "cuda" and not _sm89_or_newer(),
    reason="torch._scaled_mm with fp8 needs CUDA sm89+ (the CPU build has it too)",
)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_scaled_mm_path(out_dtype):
    """The CUDA sm89+ path's torch._scaled_mm call (rowwise scales): the real GPU path on DEVICE=cuda, and on
    CPU, where _scaled_mm also exists. Checks argument layout and the bf16 GEMM output. Its bf16 rounding
    dominates the tolerance."""
    x, w, bias = _linear_case(3, t=5, k=32, n=48)
    wq, w_scale = quant_per_channel(w)
    xq, x_scale = quant_per_token(x)
    y = fp8_gemm_scaled_mm(xq, x_scale, wq, w_scale, bias, out_dtype)
    assert y.shape == (5, 48) and y.dtype == out_dtype
    cap = torch.cuda.get_device_capability(y.device) if y.is_cuda else None
    if out_dtype == scaled_mm_out_dtype(out_dtype, cap, torch.version.cuda):  # the GEMM writes it, bias fused
        assert_close(y, fp8_linear_ref(x, wq, w_scale, bias, out_dtype=out_dtype), "scaled_mm vs ref")
    else:  # bf16 GEMM output, then bias in fp32 (and the cast): within one bf16 step (2^-7 relative) + one fp16 step
        acc = fp8_linear_ref(x, wq, w_scale, None, out_dtype=torch.float32)  # [T, N], before the bias
        err = (y.float() - (acc + bias)).abs()
        bound = 2.0**-7 * acc.abs() + 2.0**-10 * (acc + bias).abs() + 1e-5
        assert torch.all(err <= bound), f"max excess {(err - bound).max():.3g}"


def test_scaled_mm_writes_fp16_where_cublaslt_can():
    """With simulated devices: fp16 straight out of the GEMM on sm90 with CUDA 12.9+ (cuBLASLt's
    rowwise path), bf16 then a cast where only CUTLASS's rowwise kernel runs (sm89, sm100, older CUDA), and on CPU."""
    f16, bf16 = torch.float16, torch.bfloat16
    assert scaled_mm_out_dtype(f16, (9, 0), "13.0") == f16
    assert scaled_mm_out_dtype(f16, (9, 0), "12.9") == f16
    assert scaled_mm_out_dtype(f16, (9, 0), "12.8") == bf16
    assert scaled_mm_out_dtype(f16, (8, 9), "13.0") == bf16
    assert scaled_mm_out_dtype(f16, (10, 0), "13.0") == bf16
    assert scaled_mm_out_dtype(f16, None, None) == bf16
    assert scaled_mm_out_dtype(bf16, (8, 9), "13.0") == bf16
    assert scaled_mm_out_dtype(torch.float32, (9, 0), "13.0") == bf16


@pytest.mark.skipif(not _sm89_or_newer(), reason="fp8_linear takes torch._scaled_mm only on CUDA sm89+")
def test_fp8_linear_uses_scaled_mm_on_sm89():
    """Where it is supported (K, N multiples of 16), fp8_linear is quant_per_token then the _scaled_mm GEMM."""
    x, w, bias = _linear_case(3, t=5, k=32, n=48)
    wq, w_scale = quant_per_channel(w)
    xq, x_scale = quant_per_token(x)
    for out_dtype in (torch.bfloat16, torch.float32):
        y = fp8_linear(x, wq, w_scale, bias, out_dtype=out_dtype)
        assert torch.equal(y, fp8_gemm_scaled_mm(xq, x_scale, wq, w_scale, bias, out_dtype)), out_dtype
