"""The C add + RMSNorm, rotary and SiLU-and-mul (kernels/cpu_ops.c) against their references, and the kernels
taking them for bf16 on CPU once loaded (the references for fp32 and fp16)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_ops, rmsnorm
from kernels.cpu_ops import CpuOps
from kernels.rmsnorm import add_rms_norm_ref, rms_norm_ref


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    k = CpuOps.get(tmp_path_factory.mktemp("cpu-kernels"), wait=True)
    assert k.lib is not None, k.error
    return k.lib


def steps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| in bf16 steps of ref."""
    spacing = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(ref.float().abs().clamp_min(1e-30)))
    return (got.float() - ref.float()).abs() / spacing


@pytest.mark.parametrize("n", [576, 64, 40, 7])  # whole 16-lane vectors, and tails
@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 576 goes to the threads
def test_add_rms_norm_matches_its_reference(lib, rows, n):
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g) * 3).bfloat16()
    res = torch.randn(rows, n, generator=g).bfloat16()
    w = (torch.rand(n, generator=g) + 0.5).bfloat16()
    (out, r), (out_ref, r_ref) = cpu_ops.add_rms_norm(lib, x, res, w, 1e-6), add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(r, r_ref)  # the residual sum rounds exactly as torch's bf16 add
    # two roundings (the normalized value, then times w): a step apart in the first can be two in the second
    assert steps(out, out_ref).max() <= 2 and (out == out_ref).float().mean() > 0.99
    plain, _ = cpu_ops.add_rms_norm(lib, x, None, w, 1e-6)
    ref = rms_norm_ref(x, w, 1e-6)
    assert steps(plain, ref).max() <= 2 and (plain == ref).float().mean() > 0.99


def test_strided_inputs_odd_values_and_3d(lib):
    """q [T, heads, D] from a wider qkv (strided rows), a NaN that stays in its row, an all-zero row."""
    qkv = torch.randn(4, 3, 96).bfloat16()
    q = qkv[:, :, :64]
    q[1, 2] = 0
    q[2, 0, 5] = float("nan")
    w = torch.rand(64).bfloat16()
    got, ref = cpu_ops.add_rms_norm(lib, q, None, w, 1e-6)[0], rms_norm_ref(q, w, 1e-6)
    assert got.shape == (4, 3, 64)
    assert torch.equal(got.isnan(), ref.isnan()) and got[2, 0].isnan().all()
    assert not got[1, 2].any()
    ok = ~ref.isnan()
    assert steps(got[ok], ref[ok]).max() <= 2


def test_rmsnorm_takes_the_c_op_for_bf16_on_cpu_only(lib, monkeypatch):
    calls = []
    real = cpu_ops.add_rms_norm
    monkeypatch.setattr(cpu_ops, "add_rms_norm", lambda *a: calls.append(a[1].dtype) or real(*a))
    monkeypatch.setattr(CpuOps, "loaded", classmethod(lambda cls, key=None: type("K", (), {"lib": lib})))
    with kernels.backend("torch"):  # the CPU path (the kernel tests' default is Triton's interpreter)
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            x, w = torch.randn(3, 32).to(dtype), torch.rand(32).to(dtype)
            rmsnorm.rms_norm(x, w, 1e-6)
            rmsnorm.add_rms_norm(x, x, w, 1e-6)
        assert calls == [torch.bfloat16, torch.bfloat16]
        monkeypatch.setattr(CpuOps, "loaded", classmethod(lambda cls, key=None: None))  # not loaded (yet)
        rmsnorm.rms_norm(torch.randn(3, 32).bfloat16(), torch.rand(32).bfloat16(), 1e-6)
        assert len(calls) == 2


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("t", [1, 7, 300])
def test_rope_is_bit_for_bit_its_reference(lib, t, d):
    """q and k as the views of a fused qkv that attention hands over (strided rows), at real positions."""
    from engine.layers.rotary import RotaryCache
    from kernels.rotary import rotary_rows, rotate_ref

    g = torch.Generator().manual_seed(t + d)
    rc = RotaryCache(d, 4096, 10000.0, None, "cpu")
    qkv = (torch.randn(t, (4 + 2 * 2) * d, generator=g) * 3).bfloat16()
    q, k = qkv[:, : 4 * d].view(t, 4, d), qkv[:, 4 * d : 6 * d].view(t, 2, d)
    c, s = rotary_rows(rc.cos, rc.sin, torch.randint(0, 4096, (t,), generator=g), torch.bfloat16)
    for x in (q, k):
        got = cpu_ops.rope(lib, x, c, s)
        assert got.is_contiguous() and torch.equal(got, rotate_ref(x, c, s))
    assert cpu_ops.rope(lib, qkv[:, :48].view(t, 1, 48), c[..., :48], s[..., :48]) is None  # D / 2 not whole vectors


def test_rounding_keeps_denormals_as_torch_does(lib):
    """Products and sums in bf16's denormal range round as torch's casts round them, not to zero (the AVX512-BF16
    conversion flushes a denormal: a vector with one takes the integer rounding); NaN and infinity pass."""
    from engine.layers.rotary import RotaryCache
    from kernels.rotary import rotary_rows, rotate_ref

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 2, 64, generator=g) * 1e-38).bfloat16()  # rotated: products below bf16's smallest normal
    x[0, 0, :16] = 3.0  # a vector of normal values beside them
    x[1, 0, 5], x[1, 0, 40] = float("inf"), float("nan")
    rc = RotaryCache(64, 64, 10000.0, None, "cpu")
    c, s = rotary_rows(rc.cos, rc.sin, torch.arange(6), torch.bfloat16)
    want = rotate_ref(x, c, s)
    assert (want.float().abs() < torch.finfo(torch.float32).tiny).sum() > 100 and (want != 0).any()
    got = cpu_ops.rope(lib, x, c, s)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~want.isnan()], want[~want.isnan()])
    res = (torch.randn(4, 64, generator=g) * 1e-38).bfloat16()  # the norm's residual sum, in the denormal range
    out, summed = cpu_ops.add_rms_norm(lib, -res * 0.5, res, torch.ones(64).bfloat16(), 1e-6)
    assert torch.equal(summed, res + -res * 0.5) and (summed != 0).any()


def test_rotary_takes_the_c_op_for_bf16_on_cpu(lib, monkeypatch):
    from engine.layers.rotary import RotaryCache

    calls = []
    real = cpu_ops.rope
    monkeypatch.setattr(cpu_ops, "rope", lambda *a: calls.append(a[1].shape) or real(*a))
    monkeypatch.setattr(CpuOps, "loaded", classmethod(lambda cls, key=None: type("K", (), {"lib": lib})))
    rc = RotaryCache(64, 128, 10000.0, None, "cpu")
    with kernels.backend("torch"):
        pos = torch.arange(3)
        for dtype in (torch.bfloat16, torch.float32):
            q, k = torch.randn(3, 4, 64).to(dtype), torch.randn(3, 2, 64).to(dtype)
            rc.apply(q, k, pos)
    assert calls == [(3, 4, 64), (3, 2, 64)]


def test_silu_and_mul_is_bit_for_bit_its_reference_at_every_bf16_gate(lib):
    """Every bf16 value as a gate (infinities, NaNs, denormals, the ends of exp's range), times up = 1 and random ups;
    rows apart (a view of a wider tensor), and rows past the threads' threshold."""
    from kernels.activation import silu_and_mul_ref

    g = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(-1, 512)
    for up in (torch.ones_like(g), torch.randn(g.shape, generator=torch.Generator().manual_seed(0)).bfloat16()):
        wide = torch.cat([g, up, torch.zeros_like(g[:, :16])], 1)  # [128, 1040]: rows 1040 apart
        x = wide[:, : 2 * 512]
        got, ref = cpu_ops.silu_and_mul(lib, x), silu_and_mul_ref(x)
        assert got.shape == (128, 512) and got.is_contiguous()
        assert torch.equal(got.view(torch.int16)[~ref.isnan()], ref.view(torch.int16)[~ref.isnan()])
        assert torch.equal(got.isnan(), ref.isnan())
    assert cpu_ops.silu_and_mul(lib, torch.randn(3, 2 * 40).bfloat16()) is None  # I not whole 16-lane vectors


def test_silu_and_mul_takes_the_c_op_for_bf16_on_cpu(lib, monkeypatch):
    from kernels import activation

    calls = []
    real = cpu_ops.silu_and_mul
    monkeypatch.setattr(cpu_ops, "silu_and_mul", lambda *a: calls.append(a[1].shape) or real(*a))
    monkeypatch.setattr(CpuOps, "loaded", classmethod(lambda cls, key=None: type("K", (), {"lib": lib})))
    with kernels.backend("torch"):
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            x = torch.randn(3, 64).to(dtype)
            assert torch.equal(activation.silu_and_mul(x), activation.silu_and_mul_ref(x))
        x = torch.randn(2, 80).bfloat16()  # I = 40: the reference
        assert torch.equal(activation.silu_and_mul(x), activation.silu_and_mul_ref(x))
    assert calls == [(3, 64), (2, 80)]
