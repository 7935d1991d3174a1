"""MXFP4 experts (GPT-OSS's checkpoints: uint8 bytes of two e2m1 codes, e8m0 scales per 32 K elements) in the fused
MoE (kernels/fused_moe.py, kernels/mxfp4.py): the torch dequantization against the e2m1 table and transformers' own,
the reference on packed weights against the reference on the dequantized ones, the Triton kernel (decoding in its K
loop) against the reference with and without biases and the clamped SwiGLU, both block sizes, the nibble order, and
the operator (dispatch, schema, fake)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kernels
import kernels.fused_moe as fm
from kernels.fused_moe import BLOCK_M, BLOCK_M_LARGE, fused_moe_ref, fused_moe_triton
from kernels.mxfp4 import FP4_VALUES, dequantize_mxfp4_ref
from tests.kernels.conftest import TOL, assert_close, to_device

SWIGLU = (1.702, 7.0)
MAGNITUDES = torch.tensor(FP4_VALUES[:8])


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., N, K] -> (q uint8 [..., N, K // 2], s uint8 [..., N, K // 32]): per group of 32 the exponent
    ceil(log2(amax / 6)), each value the nearest e2m1 code; element 2j in the low nibble."""
    g = w.unflatten(-1, (w.shape[-1] // 32, 32))  # [..., N, G, 32]
    amax = g.abs().amax(-1).clamp(min=2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)  # [..., N, G]
    scaled = g / torch.exp2(exp)[..., None]
    idx = (scaled.abs()[..., None] - MAGNITUDES).abs().argmin(-1)  # [..., N, G, 32] magnitude index
    code = (idx | ((scaled < 0).long() << 3)).flatten(-2)  # [..., N, K]
    q = code[..., 0::2] | (code[..., 1::2] << 4)
    return q.to(torch.uint8), (exp + 127).to(torch.uint8)


def case(t, h, inter, e, k, seed, dtype=torch.float32):
    """x, (q13, s13), (q2, s2), topk weights, ids, b13, b2; w13 wide enough to reach SwiGLU's clamps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    q13, s13 = pack_mxfp4(torch.randn(e, 2 * inter, h, generator=g) * 0.5)
    q2, s2 = pack_mxfp4(torch.randn(e, h, inter, generator=g) * 0.1)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, K] distinct
    w = torch.rand(t, k, generator=g).softmax(-1).to(dtype)
    b13, b2 = torch.randn(e, 2 * inter, generator=g).to(dtype), torch.randn(e, h, generator=g).to(dtype)
    return to_device(x, q13, s13, q2, s2, w, ids, b13, b2)


def _tol(ref: torch.Tensor) -> dict:
    """As test_moe_bias: fp32 tight; 16-bit two bf16 ulps of the largest output (roundings taken at other points)."""
    if ref.dtype == torch.float32:
        return TOL[torch.float32] | dict(atol=1e-4)
    return dict(rtol=1.6e-2, atol=2**-6 * ref.float().abs().max().item())


# ---- the format --------------------------------------------------------------------------------------------------
def test_dequantize_matches_the_e2m1_table_and_transformers():
    """Every byte (both nibbles), each scale in its own group of 32: the table value times 2 ** (s - 127); and
    transformers' convert_moe_packed_tensors on the checkpoint's [E, N, G, 16] blocks."""
    q = torch.arange(256, dtype=torch.uint8).reshape(1, 2, 128)  # [E, N, K // 2], K = 256: 8 groups a row
    s = torch.tensor(
        [[[127, 126, 128, 120, 130, 1, 254, 127], [100, 127, 140, 127, 127, 127, 127, 60]]], dtype=torch.uint8
    )
    out = dequantize_mxfp4_ref(q, s)
    table = torch.tensor(FP4_VALUES)
    b = q.long()
    scale = torch.exp2(s.float() - 127).repeat_interleave(32, -1)  # [E, N, K]
    want = torch.stack([table[b & 15], table[b >> 4]], -1).flatten(-2) * scale
    assert torch.equal(out, want)
    # byte 0x21 (elements 66, 67: group 2, scale 2): the low nibble 1 (0.5) first, then the high one 2 (1.0)
    assert out[0, 0, 66].item() == 1.0 and out[0, 0, 67].item() == 2.0
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = convert_moe_packed_tensors(q.unflatten(-1, (8, 16)), s, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(out, hf)
    assert torch.equal(dequantize_mxfp4_ref(q.unflatten(-1, (8, 16)), s), out)  # the checkpoint's blocks as they come
    assert dequantize_mxfp4_ref(q, s, torch.bfloat16).float().equal(out)  # exact in bf16


def test_packer_round_trips_within_e2m1_precision():
    w = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(0))
    back = dequantize_mxfp4_ref(*pack_mxfp4(w))
    amax = w.unflatten(-1, (2, 32)).abs().amax(-1).repeat_interleave(32, -1)
    assert ((back - w).abs() <= amax / 3).all()  # half the widest e2m1 step (2) at a scale below amax / 3
    assert (back - w).abs().mean() < 0.2 * w.abs().mean()  # 4 bits: about 12% here


# ---- the reference -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_on_mxfp4_equals_reference_on_dequantized(dtype):
    x, q13, s13, q2, s2, w, ids, b13, b2 = case(9, 64, 32, 4, 2, seed=1, dtype=dtype)
    kw = dict(w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)
    w13, w2 = dequantize_mxfp4_ref(q13, s13, dtype), dequantize_mxfp4_ref(q2, s2, dtype)
    with kernels.backend("torch"):  # the activations' references too
        packed = fm.fused_moe(x, q13, q2, w, ids, False, s13, s2, **kw)  # the dispatcher's reference path
        assert torch.equal(packed, fused_moe_ref(x, w13, w2, w, ids, **kw))
        assert torch.equal(fused_moe_ref(x, q13, q2, w, ids, True, s13, s2), fused_moe_ref(x, w13, w2, w, ids, True))


# ---- the Triton kernel -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [BLOCK_M, BLOCK_M_LARGE], ids=["block16", "block64"])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "biases-swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_matches_reference(dtype, extras, block, monkeypatch):
    """H = 96: the first GEMM's K loop takes 2 steps of 64 (the last half masked) or 3 of 32; I = 64: the second's
    1 of 64 or 2 of 32. 2I = 128 rows: two 64-column tiles or one of 128."""
    monkeypatch.setattr(fm, "LARGE_RUN", 0 if block == BLOCK_M_LARGE else 10**9)  # the block size under test
    seen, real = [], fm.moe_align
    monkeypatch.setattr(fm, "moe_align", lambda ids, e, b: seen.append(b) or real(ids, e, b))
    x, q13, s13, q2, s2, w, ids, b13, b2 = case(11, 96, 64, 5, 2, seed=7, dtype=dtype)
    kw = dict(w13_bias=b13, w2_bias=b2, swiglu=SWIGLU) if extras else {}
    ref = fused_moe_ref(x, q13, q2, w, ids, False, s13, s2, **kw)
    out = fused_moe_triton(x, q13, q2, w, ids, False, s13, s2, **kw)
    assert set(seen) == {block} and out.shape == x.shape and out.dtype == dtype
    assert_close(out, ref, f"MXFP4 fused_moe {dtype} {kw.keys()}", **_tol(ref))


def test_nibble_order():
    """Low and high nibble of every byte hold different codes, and each group of 32 its own scale: the kernel must
    give the output of weights built element by element (2j from the low nibble), and the nibbles swapped must
    give another output."""
    g = torch.Generator().manual_seed(3)
    e, h, inter, t = 2, 64, 32, 6
    lo = torch.randint(0, 16, (e, 2 * inter, h // 2), generator=g)
    hi = (lo + torch.randint(1, 16, lo.shape, generator=g)) % 16  # != lo everywhere
    q13 = (lo | hi << 4).to(torch.uint8)
    s13 = torch.randint(122, 128, (e, 2 * inter, h // 32), generator=g).to(torch.uint8)
    q2 = torch.randint(0, 256, (e, h, inter // 2), generator=g).to(torch.uint8)
    s2 = torch.randint(120, 124, (e, h, inter // 32), generator=g).to(torch.uint8)
    table = torch.tensor(FP4_VALUES)
    w13 = torch.empty(e, 2 * inter, h)
    w13[..., 0::2], w13[..., 1::2] = table[lo], table[hi]
    w13 *= torch.exp2(s13.float() - 127).repeat_interleave(32, -1)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g) for _ in range(t)])
    w = torch.rand(t, e, generator=g).softmax(-1)
    x, q13, s13, q2, s2, ids, w, w13 = to_device(x, q13, s13, q2, s2, ids, w, w13)
    w2 = dequantize_mxfp4_ref(q2, s2)
    want = fused_moe_ref(x, w13, w2, w, ids)
    out = fused_moe_triton(x, q13, q2, w, ids, False, s13, s2)
    assert_close(out, want, "MXFP4 nibble order", **_tol(want))
    swapped = ((q13 >> 4) | (q13 << 4)).to(torch.uint8)
    other = fused_moe_triton(x, swapped, q2, w, ids, False, s13, s2)
    assert (other - want).abs().max() > 100 * _tol(want)["atol"]


# ---- the operator ------------------------------------------------------------------------------------------------
def test_operator_with_mxfp4_experts():
    """torch.ops.llmw.fused_moe through the dispatcher (the fixture forces Triton) gives the launcher's output; the
    operator's schema and fake (opcheck), and under FakeTensorMode a [T, H] result."""
    x, q13, s13, q2, s2, w, ids, b13, b2 = case(5, 32, 32, 4, 2, seed=9, dtype=torch.bfloat16)
    args = (x, q13, q2, w, ids, False, s13, s2, b13, b2)
    out = fm.fused_moe(*args, SWIGLU)
    assert out.shape == (5, 32) and out.dtype == torch.bfloat16
    assert torch.equal(out, fused_moe_triton(*args, list(SWIGLU)))
    torch.library.opcheck(torch.ops.llmw.fused_moe, (*args, list(SWIGLU)))
    with FakeTensorMode() as mode:
        fake = torch.ops.llmw.fused_moe(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert fake.shape == (5, 32) and fake.dtype == torch.bfloat16
    with pytest.raises(AssertionError, match="need their scales"):
        fm.fused_moe(x, q13, q2, w, ids)
