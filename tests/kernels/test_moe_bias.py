"""GPT-OSS's experts in the fused MoE kernel (kernels/fused_moe.py) and kernels/activation.py: per-expert biases
(b13 before the activation, b2 inside the top-k weighting) and the clamped SwiGLU
((clamp(up, +-limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)). The Triton paths against the torch
references (fp32, bf16, fp8 experts, both block sizes), the reference against transformers' own GptOssExperts,
and the operators' schemas and fakes with the new arguments."""

import pytest
import torch

import kernels
import kernels.fused_moe as fm
from kernels.activation import swiglu_oai_and_mul, swiglu_oai_and_mul_ref
from kernels.fp8 import quant_per_channel_ref
from kernels.fused_moe import BLOCK_M, BLOCK_M_LARGE, fused_moe_ref, fused_moe_triton
from tests.kernels.conftest import TOL, assert_close, to_device

ALPHA, LIMIT = 1.702, 7.0
SWIGLU = (ALPHA, LIMIT)


def case(t, h, inter, e, k, seed, dtype=torch.float32, w_std=0.5):
    """x, w13, w2, topk weights, topk ids, b13, b2; w_std 0.5 puts a fair share of gate/up beyond +-LIMIT."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * w_std).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) * 0.1).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, K] distinct
    w = torch.rand(t, k, generator=g).softmax(-1).to(dtype)
    b13 = torch.randn(e, 2 * inter, generator=g).to(dtype)
    b2 = torch.randn(e, h, generator=g).to(dtype)
    return to_device(x, w13, w2, w, ids, b13, b2)


def _tol(ref: torch.Tensor) -> dict:
    """fp32: tight. 16-bit: two bf16 ulps of the largest output. Large gate/up values (to reach the clamps) make the
    intermediate roundings, which the kernel and the reference take at different points, that coarse."""
    if ref.dtype == torch.float32:
        return TOL[torch.float32] | dict(atol=1e-4)
    return dict(rtol=1.6e-2, atol=2**-6 * ref.float().abs().max().item())


def _fp8(w):
    q, s = zip(*(quant_per_channel_ref(w[i]) for i in range(w.shape[0])))
    return torch.stack(q), torch.stack(s)  # [E, N, K] e4m3, [E, N, 1] fp32


# ---- the activation ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("t,inter", [(5, 16), (3, 1100)], ids=["small", "two-blocks"])
def test_swiglu_oai_and_mul_triton_matches_ref(t, inter, dtype):
    x = (torch.randn(t, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 6).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    assert (gate > LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any()  # every clamp is exercised
    x = to_device(x)
    out = swiglu_oai_and_mul(x, ALPHA, LIMIT)  # the Triton kernel (the fixture selects it)
    ref = swiglu_oai_and_mul_ref(x, ALPHA, LIMIT)
    assert out.shape == (t, inter) and out.dtype == dtype
    assert_close(out, ref, "swiglu_oai_and_mul")


def test_swiglu_oai_ref_is_hf_formula_and_clamps_matter():
    """fp32: the reference is GptOssExperts._apply_gate's formula (on the de-interleaved halves); without the clamps
    (limit = inf) the result differs, so the clamps are exercised."""
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 6
    gate, up = x.chunk(2, dim=-1)
    g, u = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    hf = (u + 1) * (g * torch.sigmoid(g * ALPHA))
    assert_close(swiglu_oai_and_mul_ref(x, ALPHA, LIMIT), hf, "ref vs HF", atol=1e-6, rtol=1e-6)
    assert_close(swiglu_oai_and_mul(to_device(x), ALPHA, LIMIT).cpu(), hf, "triton vs HF", atol=1e-5, rtol=1e-5)
    unclamped = swiglu_oai_and_mul(to_device(x), ALPHA, float("inf")).cpu()
    assert (unclamped - hf).abs().max() > 1.0


# ---- the fused MoE -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [BLOCK_M, BLOCK_M_LARGE], ids=["block16", "block64"])
@pytest.mark.parametrize("act", ["swiglu", "silu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_with_biases_matches_reference(dtype, act, block, monkeypatch):
    monkeypatch.setattr(fm, "LARGE_RUN", 0 if block == BLOCK_M_LARGE else 10**9)  # the block size under test
    seen, real = [], fm.moe_align
    monkeypatch.setattr(fm, "moe_align", lambda ids, e, b: seen.append(b) or real(ids, e, b))
    x, w13, w2, w, ids, b13, b2 = case(11, 32, 48, 5, 2, seed=7, dtype=dtype)
    kw = dict(gelu=act == "gelu", w13_bias=b13, w2_bias=b2, swiglu=SWIGLU if act == "swiglu" else None)
    ref = fused_moe_ref(x, w13, w2, w, ids, **kw)
    out = fused_moe_triton(x, w13, w2, w, ids, **kw)
    assert set(seen) == {block}
    assert_close(out, ref, f"fused_moe {act} with biases", **_tol(ref))
    assert_close(fm.fused_moe(x, w13, w2, w, ids, **kw), out, "fused_moe dispatch", atol=0, rtol=0)


@pytest.mark.parametrize("block", [BLOCK_M, BLOCK_M_LARGE], ids=["block16", "block64"])
def test_fp8_experts_with_biases_and_swiglu(block, monkeypatch):
    """fp8 weights: the per-channel scale first, then the bias (the reference dequantizes, then adds)."""
    monkeypatch.setattr(fm, "LARGE_RUN", 0 if block == BLOCK_M_LARGE else 10**9)
    x, w13, w2, w, ids, b13, b2 = case(10, 32, 48, 5, 2, seed=3, dtype=torch.bfloat16)
    (q13, s13), (q2, s2) = _fp8(w13), _fp8(w2)
    kw = dict(w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)
    ref = fused_moe_ref(x, q13, q2, w, ids, False, s13, s2, **kw)
    out = fused_moe_triton(x, q13, q2, w, ids, False, s13, s2, **kw)
    assert_close(out, ref, "fp8 experts with biases", **_tol(ref))
    bf16 = fused_moe_ref(x, w13, w2, w, ids, **kw)
    assert (ref.float() - bf16.float()).abs().max() < 0.5  # fp8 stays near bf16


def test_biases_matter():
    x, w13, w2, w, ids, b13, b2 = case(9, 32, 16, 4, 2, seed=5)
    full = fused_moe_triton(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)
    for name, kw in {
        "none": dict(),
        "b13 zeroed": dict(w13_bias=torch.zeros_like(b13), w2_bias=b2),
        "b2 zeroed": dict(w13_bias=b13, w2_bias=torch.zeros_like(b2)),
    }.items():
        for fn in (fused_moe_triton, fused_moe_ref):
            other = fn(x, w13, w2, w, ids, swiglu=SWIGLU, **kw)
            assert (other - full).abs().max() > 1e-2, f"{fn.__name__} with biases {name}: the same output"
    # b2 is inside the top-k weighting: zero weights give zero output, biases or not
    zero = fused_moe_triton(x, w13, w2, torch.zeros_like(w), ids, w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)
    assert torch.equal(zero, torch.zeros_like(zero))


def _hf_experts(h, inter, e, seed):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=h, intermediate_size=inter, num_local_experts=e, num_experts_per_tok=2)
    experts = GptOssExperts(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p, std in ((experts.gate_up_proj, 0.5), (experts.gate_up_proj_bias, 1.0)):
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for p, std in ((experts.down_proj, 0.2), (experts.down_proj_bias, 1.0)):
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return cfg, experts


def _ours(experts):
    """HF's [E, H, 2I] interleaved gate/up -> w13 [E, 2I, H], gate rows then up rows; [E, I, H] -> w2 [E, H, I]."""
    gu, gub = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    w13 = torch.cat([gu[..., ::2], gu[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    b13 = torch.cat([gub[..., ::2], gub[..., 1::2]], dim=-1).contiguous()
    w2 = experts.down_proj.detach().transpose(1, 2).contiguous()
    return w13, w2, b13, experts.down_proj_bias.detach().clone()


def test_matches_transformers_gpt_oss_experts():
    """fp32, a tiny GptOssConfig: HF's GptOssExperts and ours (its weights re-laid out) on the same routing; the
    reference in plain torch and the Triton path both give HF's output."""
    h, inter, e, t = 32, 16, 4, 13
    cfg, experts = _hf_experts(h, inter, e, seed=1)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == SWIGLU
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])  # [T, 2]
    w = torch.rand(t, 2, generator=g).softmax(-1)
    with torch.no_grad():
        hf = experts(x, router_indices=ids, routing_weights=w)
        gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]  # [T, 2I], expert 0's
    assert (gate_up[:, ::2] > LIMIT).any() and (gate_up[:, 1::2].abs() > LIMIT).any()  # the clamps are reached
    w13, w2, b13, b2 = _ours(experts)
    with kernels.backend("torch"):
        ref = fused_moe_ref(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)
    assert_close(ref, hf, "reference vs transformers", atol=1e-5, rtol=1e-5)
    out = fused_moe_triton(
        *to_device(x, w13, w2, w, ids), w13_bias=to_device(b13), w2_bias=to_device(b2), swiglu=SWIGLU
    )
    assert_close(out.cpu(), hf, "triton vs transformers", atol=1e-4, rtol=1e-4)


# ---- the operators -----------------------------------------------------------------------------------------------
def test_operators_with_the_new_arguments():
    """opcheck (schema and fake) of llmw::fused_moe with biases and swiglu, and llmw::act_and_mul with swiglu."""
    ops = torch.ops.llmw
    x, w13, w2, w, ids, b13, b2 = case(5, 32, 16, 4, 2, seed=9)
    torch.library.opcheck(ops.fused_moe, (x, w13, w2, w, ids, False, None, None, b13, b2, list(SWIGLU)))
    torch.library.opcheck(ops.act_and_mul, (to_device(torch.randn(5, 64) * 6), False, list(SWIGLU)))
