"""RMSNorm, SiLU-and-mul and rotary kernels (Triton: interpreted on CPU, or on DEVICE) against their torch
references. Inputs are drawn on CPU, then moved to DEVICE."""

import zlib

import pytest
import torch

import kernels
from kernels.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_ref, silu_and_mul, silu_and_mul_ref
from kernels.rmsnorm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.rotary import rotary_embedding, rotary_embedding_ref
from tests.kernels.conftest import DEVICE, assert_close, to_device

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5


def _gen(*params) -> torch.Generator:
    """A generator seeded by the case's parameters, so every case draws its own inputs."""
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _randn(shape, dtype, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------- RMSNorm

NORM_SHAPES = [(1, 96), (5, 123), (2, 3, 96), (3, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(shape, dtype):
    g = _gen("rms", shape, dtype)
    x = _randn(shape, dtype, g, scale=2.0)  # [..., hidden]
    w = _randn(shape[-1:], dtype, g).add_(1.0)  # [hidden]
    x, w = to_device(x, w)
    x0 = x.clone()
    out = rms_norm(x, w, EPS)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, rms_norm_ref(x, w, EPS), "rms_norm")
    assert torch.equal(x, x0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 96), (5, 123), (2, 3, 96)])
def test_add_rms_norm(shape, dtype):
    g = _gen("add_rms", shape, dtype)
    x, res = _randn(shape, dtype, g), _randn(shape, dtype, g, scale=3.0)
    w = _randn(shape[-1:], dtype, g).add_(1.0)
    x, res, w = to_device(x, res, w)
    x0, res0 = x.clone(), res.clone()
    normed, new_res = add_rms_norm(x, res, w, EPS)
    ref_normed, ref_res = add_rms_norm_ref(x, res, w, EPS)
    assert_close(new_res, ref_res, "residual", atol=0, rtol=0)  # one rounding of x + residual: exact
    assert_close(normed, ref_normed, "normed")
    assert torch.equal(x, x0) and torch.equal(res, res0), "inputs must not be modified"


# bf16 input, fp32 output: the bf16-rounded h can differ by one bf16 ulp after a reordered fp32 sum.
TOL_BF16_IN_FP32 = dict(atol=1e-3, rtol=1.6e-2)


def test_rms_norm_strided_rows_and_fp32_weight():
    g = _gen("rms_strided")
    wide = _randn((5, 200), torch.bfloat16, g)
    w = _randn((123,), torch.float32, g).add_(1.0)  # fp32 weight promotes the output, as in torch
    wide, w = to_device(wide, w)
    x = wide[:, 7:130]  # [5, 123], row stride 200
    out = rms_norm(x, w, EPS)
    ref = rms_norm_ref(x, w, EPS)
    assert out.dtype == ref.dtype == torch.float32
    assert_close(out, ref, "rms_norm strided", **TOL_BF16_IN_FP32)


def test_rms_norm_detects_wrong_weight():
    g = _gen("rms_wrong")
    x = _randn((5, 123), torch.float32, g)
    w = _randn((123,), torch.float32, g).add_(1.0)
    x, w = to_device(x, w)
    out = rms_norm(x, w, EPS)
    w_bad = w.clone()
    w_bad[17] += 1e-3
    with pytest.raises(AssertionError, match="mismatches"):
        assert_close(out, rms_norm_ref(x, w_bad, EPS), "rms_norm")


def test_add_rms_norm_detects_missing_residual():
    g = _gen("add_rms_wrong")
    x, res = _randn((3, 96), torch.bfloat16, g), _randn((3, 96), torch.bfloat16, g)
    w = _randn((96,), torch.bfloat16, g).add_(1.0)
    x, res, w = to_device(x, res, w)
    normed, _ = add_rms_norm(x, res, w, EPS)
    with pytest.raises(AssertionError, match="mismatches"):
        assert_close(normed, rms_norm_ref(x, w, EPS), "normed")


# ---------------------------------------------------------------- SiLU and mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter", [(1, 96), (5, 123), (3, 1500)])
def test_silu_and_mul(t, inter, dtype):
    g = _gen("silu", t, inter, dtype)
    x = to_device(_randn((t, 2 * inter), dtype, g, scale=3.0))  # [T, 2*I]
    out = silu_and_mul(x)
    assert out.shape == (t, inter) and out.dtype == dtype
    assert_close(out, silu_and_mul_ref(x), "silu_and_mul")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter", [(1, 96), (5, 123)])
def test_gelu_tanh_and_mul(t, inter, dtype):
    """Gemma's GeGLU: F.gelu(gate, approximate="tanh") * up, and not the exact-erf GELU or SiLU."""
    g = _gen("gelu", t, inter, dtype)
    x = to_device(_randn((t, 2 * inter), dtype, g, scale=3.0))
    out = gelu_tanh_and_mul(x)
    assert out.shape == (t, inter) and out.dtype == dtype
    assert_close(out, gelu_tanh_and_mul_ref(x), "gelu_tanh_and_mul")
    gate, up = x.float().chunk(2, dim=-1)
    assert (out.float() - torch.nn.functional.gelu(gate) * up).abs().max() > 1e-4 or dtype != torch.float32


def test_silu_and_mul_strided_rows_and_detects_swapped_halves():
    g = _gen("silu_strided")
    wide = to_device(_randn((5, 300), torch.bfloat16, g, scale=3.0))
    x = wide[:, :246]  # [5, 246], row stride 300
    out = silu_and_mul(x)
    assert_close(out, silu_and_mul_ref(x), "silu_and_mul strided")
    swapped = torch.cat(x.chunk(2, dim=-1)[::-1], dim=-1)  # [up | gate]
    with pytest.raises(AssertionError, match="mismatches"):
        assert_close(out, silu_and_mul_ref(swapped), "silu_and_mul")


# ---------------------------------------------------------------- Rotary

MAX_POS = 64


def _tables(head_dim, max_pos=MAX_POS, theta=10000.0, scaling=None):
    from engine.layers.rotary import RotaryCache

    rc = RotaryCache(head_dim, max_pos, theta, scaling, DEVICE)  # built on CPU, then moved
    return rc.cos, rc.sin  # [max_pos, head_dim] fp32


def _qk(t, h, kvh, d, dtype, g):
    """q [T, H, D], k [T, KVH, D] drawn on CPU, on DEVICE."""
    return to_device(_randn((t, h, d), dtype, g), _randn((t, kvh, d), dtype, g))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,kvh,d", [(1, 4, 2, 64), (5, 3, 1, 128), (5, 9, 3, 48)])
def test_rotary(t, h, kvh, d, dtype):
    g = _gen("rope", t, h, kvh, d, dtype)
    q, k = _qk(t, h, kvh, d, dtype, g)
    cos, sin = _tables(d)
    positions = to_device(torch.randperm(MAX_POS, generator=g)[:t])  # [T], out of order
    ref_q, ref_k = rotary_embedding_ref(q, k, cos, sin, positions)
    out_q, out_k = rotary_embedding(q.clone(), k.clone(), cos, sin, positions)
    # Same roundings in the same order as the reference: bit-exact in every dtype (this is what catches the
    # interpreter's truncating fp32 -> bf16 cast, which the bf16 tolerance alone would mostly let through).
    assert_close(out_q, ref_q, "q", atol=0, rtol=0)
    assert_close(out_k, ref_k, "k", atol=0, rtol=0)


def test_rotary_matches_engine_and_works_in_place_on_qkv_views():
    from engine.layers.rotary import RotaryCache

    g = _gen("rope_views")
    t, h, kvh, d = 5, 4, 2, 64
    rc = RotaryCache(d, MAX_POS, 10000.0, None, DEVICE)
    qkv = to_device(_randn((t, (h + 2 * kvh) * d), torch.bfloat16, g))  # [T, (H + 2*KVH) * D], as a fused projection
    q = qkv[:, : h * d].view(t, h, d)  # [T, H, D], token stride (H+2*KVH)*D
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)  # [T, KVH, D]
    v_before = qkv[:, (h + kvh) * d :].clone()
    positions = torch.tensor([7, 3, 63, 0, 3], device=DEVICE)
    eng_q, eng_k = rc.apply(q.clone(), k.clone(), positions)
    out_q, out_k = rotary_embedding(q, k, rc.cos, rc.sin, positions)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr(), "Triton path is in place"
    assert_close(out_q, eng_q, "q")
    assert_close(out_k, eng_k, "k")
    assert torch.equal(qkv[:, (h + kvh) * d :], v_before), "v must be untouched"


def test_rotary_llama3_scaling():
    d, max_pos = 64, 16384
    scaling = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    cos, sin = _tables(d, max_pos, 500000.0, scaling)
    plain_cos, _ = _tables(d, max_pos, 500000.0, None)
    assert not torch.allclose(cos[1000], plain_cos[1000]), "llama3 scaling must change the tables"
    g = _gen("rope_llama3")
    q, k = _qk(5, 4, 2, d, torch.bfloat16, g)
    positions = torch.tensor([16383, 5, 9000, 0, 8191], device=DEVICE)
    ref_q, ref_k = rotary_embedding_ref(q, k, cos, sin, positions)
    out_q, out_k = rotary_embedding(q.clone(), k.clone(), cos, sin, positions)
    assert_close(out_q, ref_q, "q")
    assert_close(out_k, ref_k, "k")
    # the unscaled tables must give a visibly different answer at these positions
    with pytest.raises(AssertionError, match="mismatches"):
        assert_close(out_q, rotary_embedding_ref(q, k, plain_cos, sin, positions)[0], "q")


def test_rotary_detects_wrong_positions():
    g = _gen("rope_wrong")
    q, k = _qk(5, 3, 1, 48, torch.float32, g)
    cos, sin = _tables(48)
    positions = torch.tensor([4, 1, 30, 2, 9], device=DEVICE)
    out_q, _ = rotary_embedding(q.clone(), k.clone(), cos, sin, positions)
    with pytest.raises(AssertionError, match="mismatches"):
        assert_close(out_q, rotary_embedding_ref(q, k, cos, sin, positions + 1)[0], "q")


def test_torch_backend_is_the_reference():
    kernels.set_backend("torch")  # the autouse fixture restores "auto" afterwards
    g = _gen("backend")
    x = _randn((3, 96), torch.bfloat16, g)
    w = _randn((96,), torch.bfloat16, g)
    x, w = to_device(x, w)
    assert torch.equal(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))
    assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))
    q, k = _qk(2, 2, 1, 64, torch.bfloat16, g)
    cos, sin = _tables(64)
    pos = torch.tensor([5, 1], device=DEVICE)
    out_q, _ = rotary_embedding(q, k, cos, sin, pos)
    assert out_q.data_ptr() != q.data_ptr() and torch.equal(out_q, rotary_embedding_ref(q, k, cos, sin, pos)[0])


def test_the_torch_path_gathers_a_steps_rotary_rows_once_for_every_layer(monkeypatch):
    """RotaryCache.apply on the torch path (CPU) indexes the cos/sin tables once per positions tensor, not once per
    layer, and gathers again when the positions change in place (its version) or the dtype changes; every result is
    rotary_embedding_ref's, bit for bit."""
    import kernels.rotary
    from engine.layers import rotary as layer_rotary

    calls = []
    real = kernels.rotary.rotary_rows
    monkeypatch.setattr(layer_rotary, "rotary_rows", lambda *a: calls.append(1) or real(*a))
    rc = layer_rotary.RotaryCache(16, 64, 10000.0, None, "cpu")
    g = _gen("memo")
    pos = torch.tensor([3, 9, 17])
    with kernels.backend("torch"):
        for dtype in (torch.float32, torch.float32, torch.bfloat16):
            for _layer in range(3):
                q, k = _randn((3, 4, 16), dtype, g), _randn((3, 2, 16), dtype, g)
                want = rotary_embedding_ref(q, k, rc.cos, rc.sin, pos)
                got = rc.apply(q, k, pos)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            if len(calls) == 1:
                pos.add_(1)  # in place: the next step's positions in the same buffer
    assert len(calls) == 3  # the first step, the in-place change, the dtype
