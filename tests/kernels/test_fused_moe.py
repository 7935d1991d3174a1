"""The fused MoE kernel (kernels/fused_moe.py) against its torch reference and against a plain per-token loop:
odd expert counts, top-1/2/8, experts that receive no tokens, GELU and SiLU, fp8 experts with per-channel scales."""

import pytest
import torch

from kernels.fp8 import quant_per_channel_ref
from kernels.fused_moe import BLOCK_M, BLOCK_M_LARGE, block_size_for, fused_moe_ref, fused_moe_triton, moe_align, tiles
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


def test_block_size_follows_the_experts_runs():
    """16-row blocks while the mean run per expert is short (decode), 64-row blocks with wider tiles once it is
    long (prefill): a Mixtral-shaped step (8 experts, top-2) at 1, 64 and 2048 tokens; a Qwen3-MoE-shaped one
    (128 experts, top-8) keeps 16-row blocks at 256 tokens."""
    assert [block_size_for(t * 2, 8) for t in (1, 64, 2048)] == [BLOCK_M, BLOCK_M, BLOCK_M_LARGE]
    assert block_size_for(256 * 8, 128) == BLOCK_M and block_size_for(2048 * 8, 128) == BLOCK_M_LARGE
    small, large = tiles(BLOCK_M, 28672, 4096, True), tiles(BLOCK_M_LARGE, 28672, 4096, True)
    assert (small["BLOCK_N"], small["BLOCK_K"], small["num_warps"], small["num_stages"]) == (64, 64, 4, 3)
    assert (large["BLOCK_N"], large["BLOCK_K"], large["num_warps"], large["num_stages"]) == (128, 32, 4, 4)
    assert tiles(BLOCK_M_LARGE, 28672, 4096, False)["num_stages"] == 3  # fp32 operands: twice the shared memory
    assert tiles(BLOCK_M_LARGE, 48, 32, True)["BLOCK_N"] == 64  # never wider than the weight


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
def test_large_blocks_match_reference(gelu):
    """A prefill-sized step (150 tokens, top-2 of 4 experts, one idle: runs of ~100 rows, padded to 64) through the
    64-row blocks, in fp32 and with fp8 experts."""
    t, e, k = 150, 4, 2
    assert block_size_for(t * k, e) == BLOCK_M_LARGE
    x, w13, w2, w, ids = case(t, 32, 48, e, k, seed=11, only=[0, 1, 3])
    ref = fused_moe_ref(x, w13, w2, w, ids, gelu)
    assert_close(ref.cpu(), per_token(x, w13, w2, w, ids, gelu), "reference vs definition", atol=1e-4, rtol=1e-4)
    assert_close(fused_moe_triton(x, w13, w2, w, ids, gelu), ref, "fused_moe", **TOL[torch.float32] | dict(atol=1e-4))
    q13, s13 = zip(*(quant_per_channel_ref(w13[i]) for i in range(e)))
    q2, s2 = zip(*(quant_per_channel_ref(w2[i]) for i in range(e)))
    q13, s13, q2, s2 = torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)
    out = fused_moe_triton(x, q13, q2, w, ids, gelu, s13, s2)
    assert_close(out, fused_moe_ref(x, q13, q2, w, ids, gelu, s13, s2), "fp8 experts", atol=1e-4, rtol=1e-4)


def test_alignment_at_the_large_block():
    ids = torch.tensor([[0, 2]] * 40 + [[2, 1]] * 30)  # experts 0: 40 slots, 1: 30, 2: 70; 3 idle
    slots, experts = moe_align(ids, 4, block_m=BLOCK_M_LARGE)
    assert slots.numel() == experts.numel() * 64 and slots.numel() >= 140 + 4 * 63
    runs: dict[int, list[int]] = {}
    for i, ex in enumerate(experts.tolist()):
        if ex >= 0:
            runs.setdefault(ex, []).extend(slots[i * 64 : (i + 1) * 64].tolist())
    real = {ex: [s for s in r if s < 140] for ex, r in runs.items()}
    assert {ex: len(r) for ex, r in runs.items()} == {0: 64, 1: 64, 2: 128}  # each run padded to whole blocks
    assert real == {ex: sorted(s for s in range(140) if int(ids.flatten()[s]) == ex) for ex in (0, 1, 2)}
