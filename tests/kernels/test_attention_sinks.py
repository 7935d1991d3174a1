"""Attention sinks (GPT-OSS): a learned logit per query head that joins each row's softmax denominator and adds no
value. The references against HF transformers' eager GptOss attention (written out below), then the paged and
prefill Triton kernels (interpreter on CPU, or on DEVICE) against the references: mixed and decode batches,
flash-decoding splits, sliding windows, an fp8 cache, and sinks large enough that a kernel ignoring them fails."""

import pytest
import torch

from kernels.paged_attention import paged_attention, paged_attention_ref, paged_attention_triton
from kernels.prefill_attention import prefill_attention, prefill_attention_ref, prefill_attention_triton
from tests.kernels.conftest import DEVICE, TOL, assert_close, to_device
from tests.kernels.test_paged_attention import FP8, FP8_TOL, MIXED, make_batch
from tests.kernels.test_prefill_attention import SMALL

# decodes, one over a context of 2 (three flash-decoding splits leave one empty), and prefill chunks over cached
# positions, one of them a full tile of the paged kernel (BLOCK_Q = 8 at H=4, KVH=2) and more
BATCH = MIXED + [(1, 2), (11, 19)]
DECODE = [(1, 40), (1, 2), (1, 17), (1, 9)]


def make_sinks(h, seed, shift=0.0, dtype=torch.float32):
    """Per-head sinks around `shift`, of the size of the scores (q.k * d**-0.5 ~ N(0, 1) here), so they matter."""
    g = torch.Generator().manual_seed(seed)
    return to_device((torch.randn(h, generator=g) * 1.5 + shift).to(dtype))


def hf_eager(args, sinks, window=None):
    """GptOss eager_attention_forward of HF transformers, per sequence in fp64 from K/V gathered slot by slot:
    scaled scores plus an additive mask, the sink concatenated as one more column, max subtracted, softmax, the sink
    column dropped, times V."""
    q, kc, vc = (args[k].double().cpu() for k in ("q", "k_cache", "v_cache"))
    bt, lens, qsl = args["block_tables"].cpu(), args["seq_lens"].tolist(), args["query_start_loc"].tolist()
    kvh, _, bs, _ = kc.shape
    h = q.shape[1]
    out = torch.zeros_like(q)
    for i, ctx in enumerate(lens):
        n = qsl[i + 1] - qsl[i]
        key = torch.stack([kc[:, bt[i, p // bs], p % bs] for p in range(ctx)], 1)  # [KVH, ctx, D]
        value = torch.stack([vc[:, bt[i, p // bs], p % bs] for p in range(ctx)], 1)
        key, value = (x.repeat_interleave(h // kvh, 0)[None] for x in (key, value))  # repeat_kv: [1, H, ctx, D]
        query = q[qsl[i] : qsl[i + 1]].transpose(0, 1)[None]  # [1, H, n, D]
        weights = query @ key.transpose(2, 3) * args["scale"]  # [1, H, n, ctx]
        q_pos, k_pos = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
        allowed = (k_pos <= q_pos) & (k_pos > q_pos - window if window else True)
        mask = torch.zeros(n, ctx, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
        weights = weights + mask
        sink = sinks.double().cpu().reshape(1, -1, 1, 1).expand(1, -1, n, -1)
        combined = torch.cat([weights, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1]
        out[qsl[i] : qsl[i + 1]] = (probs @ value)[0].transpose(0, 1)
    return out.float()


@pytest.mark.parametrize("window", [None, 5])
def test_references_match_hf_eager(window):
    args = make_batch(BATCH, h=4, kvh=2, d=32, bs=4, poison=False, seed=31)
    sinks = make_sinks(4, seed=31)
    expected = hf_eager(args, sinks, window)
    for name, ref in [("paged ref", paged_attention_ref), ("prefill ref", prefill_attention_ref)]:
        assert_close(ref(**args, window=window, sinks=sinks).cpu(), expected, name, **TOL[torch.float32])


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("spec", ["decode", "mixed"])
def test_paged_kernel(spec, splits):
    decode = spec == "decode"
    args = make_batch(DECODE if decode else BATCH, h=4, kvh=2, d=32, bs=4, seed=37)
    sinks = make_sinks(4, seed=37)
    ref = paged_attention_ref(**args, sinks=sinks)
    out = paged_attention_triton(**args, max_query_len=1 if decode else None, num_splits=splits, sinks=sinks)
    assert torch.isfinite(out).all()
    assert_close(out, ref, f"paged {spec} splits={splits}")
    if not decode:  # a window with splits: a split's share may hold no visible position for some rows
        ref = paged_attention_ref(**args, window=6, sinks=sinks)
        assert_close(paged_attention_triton(**args, num_splits=splits, window=6, sinks=sinks), ref, "paged window")


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_kernel(window):
    args = make_batch(BATCH + [(21, 30)], h=4, kvh=2, d=32, bs=4, seed=41)
    sinks = make_sinks(4, seed=41)
    ref = prefill_attention_ref(**args, window=window, sinks=sinks)
    out = prefill_attention_triton(**args, window=window, sinks=sinks, tiles=SMALL)
    assert torch.isfinite(out).all()
    assert_close(out, ref, f"prefill window={window}")


def test_operators_and_fp8_cache():
    # through the torch operators (the schema's sinks argument), an fp8 cache with k/v scales, bf16 q and sinks
    args = make_batch(BATCH, h=4, kvh=2, d=32, bs=4, dtype=torch.bfloat16, kv_dtype=FP8, seed=43)
    assert args["k_scale"] is not None
    sinks = make_sinks(4, seed=43, dtype=torch.bfloat16)
    for window in (None, 5):
        ref = paged_attention_ref(**args, window=window, sinks=sinks)
        assert_close(prefill_attention_ref(**args, window=window, sinks=sinks), ref, "refs", **FP8_TOL)
        assert_close(paged_attention(**args, num_splits=3, window=window, sinks=sinks), ref, "paged fp8", **FP8_TOL)
        assert_close(prefill_attention(**args, window=window, sinks=sinks), ref, "prefill fp8", **FP8_TOL)


def test_sinks_change_the_output():
    # large sinks take most of each row's weight: a kernel that ignored them would fail the comparisons above
    args = make_batch(BATCH, h=4, kvh=2, d=32, bs=4, seed=47)
    sinks = make_sinks(4, seed=47, shift=4.0)
    plain = paged_attention_ref(**args)
    for name, out in [
        ("paged ref", paged_attention_ref(**args, sinks=sinks)),
        ("paged", paged_attention_triton(**args, num_splits=3, sinks=sinks)),
        ("prefill", prefill_attention_triton(**args, sinks=sinks, tiles=SMALL)),
    ]:
        assert (out - plain).abs().max() > 0.3, name
        assert out.abs().mean() < plain.abs().mean() / 2, name  # the sink's share carries no value
    with pytest.raises(AssertionError):
        assert_close(paged_attention_ref(**args, sinks=sinks), plain, "sinks ignored")
    # sinks far below every score weigh nothing: the result without sinks
    low = torch.full((4,), -1e4, device=DEVICE)
    assert_close(paged_attention_triton(**args, num_splits=3, sinks=low), plain, "paged, low sinks")
    assert_close(prefill_attention_triton(**args, sinks=low, tiles=SMALL), plain, "prefill, low sinks")


def test_rows_with_nothing_visible_are_zero():
    # the engine's warm-up shape (context 0 under 4 query tokens): only the sink is left, so the output is 0, no NaN
    args = make_batch([(4, 4)] * 4, h=4, kvh=2, d=32, bs=4, seed=53)
    args["seq_lens"] = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    sinks = make_sinks(4, seed=53)
    zeros = torch.zeros_like(args["q"])
    for name, out in [
        ("paged ref", paged_attention_ref(**args, sinks=sinks)),
        ("prefill ref", prefill_attention_ref(**args, sinks=sinks)),
        ("paged", paged_attention_triton(**args, sinks=sinks)),
        ("paged split", paged_attention_triton(**args, num_splits=3, sinks=sinks)),
        ("prefill", prefill_attention_triton(**args, sinks=sinks, tiles=SMALL)),
    ]:
        assert torch.equal(out, zeros), name
