"""The fused MoE kernel (kernels/fused_moe.py) against its torch reference and against a plain per-token loop:
odd expert counts, top-1/2/8, experts that receive no tokens, GELU and SiLU, fp8 experts with per-channel scales."""

import pytest
import torch

from kernels.fp8 import quant_per_channel_ref
from kernels.fused_moe import fused_moe_ref, fused_moe_triton, moe_align
from tests.kernels.conftest import TOL, assert_close, to_device


def case(t, h, inter, e, k, seed, dtype=torch.float32, only=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) * 0.2).to(dtype)
    pool = torch.tensor(only if only is not None else range(e))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)])  # [T, K] distinct
    w = torch.rand(t, k, generator=g).softmax(-1).to(dtype)
    return to_device(x, w13, w2, w, ids)


def per_token(x, w13, w2, w, ids, gelu=False):
    """The definition, one token and one expert at a time (fp32)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].float().cpu() @ x[t].float().cpu()).chunk(2)
            a = torch.nn.functional.gelu(gate, approximate="tanh") if gelu else torch.nn.functional.silu(gate)
            out[t] += float(w[t, j]) * (w2[e].float().cpu() @ (a * up))
    return out


@pytest.mark.parametrize(
    "t,h,inter,e,k,only",
    [(7, 32, 48, 5, 2, None), (1, 32, 16, 3, 1, None), (12, 48, 32, 8, 8, None), (9, 32, 32, 6, 2, [1, 4])],
    ids=["odd-experts-top2", "one-token-top1", "top8-of-8", "four-experts-idle"],
)
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
def test_matches_reference_and_definition(t, h, inter, e, k, only, gelu):
    x, w13, w2, w, ids = case(t, h, inter, e, k, seed=t + e + k, only=only)
    ref = fused_moe_ref(x, w13, w2, w, ids, gelu)
    assert_close(ref.cpu(), per_token(x, w13, w2, w, ids, gelu), "reference vs definition", atol=1e-4, rtol=1e-4)
    out = fused_moe_triton(x, w13, w2, w, ids, gelu)
    assert_close(out, ref, "fused_moe", **TOL[torch.float32] | dict(atol=1e-4))


def test_bf16_and_fp8_experts():
    x, w13, w2, w, ids = case(10, 32, 48, 5, 2, seed=3, dtype=torch.bfloat16)
    assert_close(
        fused_moe_triton(x, w13, w2, w, ids),
        fused_moe_ref(x, w13, w2, w, ids),
        "bf16",
        **TOL[torch.bfloat16] | dict(atol=2e-2),
    )
    q13, s13 = zip(*(quant_per_channel_ref(w13[i]) for i in range(5)))
    q2, s2 = zip(*(quant_per_channel_ref(w2[i]) for i in range(5)))
    q13, s13, q2, s2 = torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)  # [E, N, K], [E, N, 1]
    ref = fused_moe_ref(x, q13, q2, w, ids, False, s13, s2)
    out = fused_moe_triton(x, q13, q2, w, ids, False, s13, s2)
    assert_close(out, ref, "fp8 experts", **TOL[torch.bfloat16] | dict(atol=2e-2))
    assert (ref.float() - fused_moe_ref(x, w13, w2, w, ids).float()).abs().max() < 0.3  # fp8 stays near bf16


def test_alignment_pads_each_expert_to_a_block():
    ids = torch.tensor([[2, 0], [2, 4], [0, 2]])  # experts 0: 2 slots, 2: 3 slots, 4: 1 slot; 1 and 3 idle
    slots, experts = moe_align(ids, 5, block_m=4)
    assert slots.numel() == 24  # the worst case, 6 slots + 5 experts x 3 pads = 21, rounded up to blocks of 4
    runs = {int(e): slots[i * 4 : i * 4 + 4].tolist() for i, e in enumerate(experts.tolist()) if e >= 0}
    assert runs == {0: [1, 4, 6, 6], 2: [0, 2, 5, 6], 4: [3, 6, 6, 6]}  # sentinel 6 = T*K
