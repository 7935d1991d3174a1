"""Multi-LoRA shrink / expand (kernels/lora.py): Triton (interpreted on CPU, or on DEVICE) against the torch
reference, and the reference against the definition: a per-token loop over unpadded (true-rank) adapters.
Inputs are drawn on CPU, then moved to DEVICE; the per-token definition runs on CPU copies."""

import zlib

import pytest
import torch

import kernels
from kernels.lora import (
    _slot_groups,
    add_lora,
    add_lora_bmm,
    add_lora_ref,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
    slot_groups,
)
from tests.kernels.conftest import TOL, assert_close, to_device

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
Y_TOL = TOL[torch.float32]  # shrink output is fp32; 16-bit products are exact in fp32, only the sum order differs


def _gen(*params) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _adapters(ranks, r_max, d_in, d_out, dtype, g):
    """Slot weights zero-padded to r_max, and the true-rank (unpadded) ones the definition uses.
    Scales keep y ~ N(0, 1) and the delta ~ N(0, 1/4), as B carries the folded alpha / r."""
    a = torch.zeros(len(ranks), r_max, d_in, dtype=dtype)  # [S, R, IN]
    b = torch.zeros(len(ranks), d_out, r_max, dtype=dtype)  # [S, OUT, R]
    for s, r in enumerate(ranks):
        a[s, :r] = (torch.randn(r, d_in, generator=g) / d_in**0.5).to(dtype)
        b[s, :, :r] = (torch.randn(d_out, r, generator=g) * 0.5 / r**0.5).to(dtype)
    return a, b, [a[s, :r].clone() for s, r in enumerate(ranks)], [b[s, :, :r].clone() for s, r in enumerate(ranks)]


def _def_shrink(x, a_true, slots, r_max):
    """The definition, one token at a time: y[t, :r] = A_s @ x[t] (true rank r), 0 elsewhere."""
    y = torch.zeros(len(slots), r_max)  # [T, R]
    for t, s in enumerate(slots):
        if s >= 0:
            y[t, : a_true[s].shape[0]] = a_true[s].float() @ x[t].cpu().float()
    return y


def _def_add(out, x, a_true, b_true, slots, offset):
    """out[t, offset:offset+OUT] += B_s @ (A_s @ x[t]) in fp32, rounded once; slot -1 rows untouched."""
    exp = out.cpu().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            cols = slice(offset, offset + b_true[s].shape[0])
            delta = b_true[s].float() @ (a_true[s].float() @ x[t].cpu().float())  # [OUT]
            exp[t, cols] = (exp[t, cols].float() + delta).to(out.dtype)
    return exp.to(out.device)


# (slots per token, ranks per slot, R, IN, OUT, offset, out width): decode-like (one token per slot, one slot
# unused, rank 1), a prefill mix (runs, interleaving, -1 in between; OUT 70 spans two column tiles; K 130 three
# K tiles), one adapter for the whole batch over two token tiles, and no adapter at all.
CASES = {
    "decode": ([2, -1, 0, 3, 1], [8, 4, 8, 1, 8], 8, 37, 29, 0, 29),
    "prefill_mix": ([1] * 7 + [-1] * 3 + [0] * 6 + [1, 0, -1], [16, 5], 16, 130, 70, 9, 100),
    "one_adapter": ([0] * 17, [3, 8], 8, 48, 24, 24, 48),
    "no_adapter": ([-1, -1, -1], [8], 8, 16, 16, 0, 16),
    "run_and_decodes": ([0] * 20 + [1, 2, 0, -1, 1], [4, 8, 2], 8, 24, 40, 4, 48),
}


def _case(name, dtype):
    slots, ranks, r_max, d_in, d_out, offset, width = CASES[name]
    g = _gen(name, dtype)
    x = torch.randn(len(slots), d_in, generator=g).to(dtype)  # [T, IN]
    a, b, a_true, b_true = _adapters(ranks, r_max, d_in, d_out, dtype, g)
    out = torch.randn(len(slots), width, generator=g).to(dtype)  # [T, width]: the base layer's output
    token_slot = torch.tensor(slots, dtype=torch.int32 if dtype == torch.float16 else torch.int64)
    return slots, offset, a_true, b_true, *to_device(x, a, b, out, token_slot)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_lora_shrink(name, dtype):
    slots, _, a_true, _, x, a, _, _, token_slot = _case(name, dtype)
    y = lora_shrink(x, a, token_slot)
    assert y.shape == (len(slots), a.shape[1]) and y.dtype == torch.float32
    ref = lora_shrink_ref(x, a, token_slot)
    assert_close(y, ref, "lora_shrink", **Y_TOL)
    assert_close(ref.cpu(), _def_shrink(x, a_true, slots, a.shape[1]), "lora_shrink_ref", **Y_TOL)


@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_lora_expand(name, dtype, add):
    slots, offset, a_true, b_true, x, a, b, out, token_slot = _case(name, dtype)
    y = lora_shrink_ref(x, a, token_slot)  # [T, R] fp32
    base = out.clone()
    res = lora_expand(y, b, token_slot, out, offset, add=add)
    assert res is out
    ref = lora_expand_ref(y, b, token_slot, base.clone(), offset, add=add)
    assert_close(out, ref, "lora_expand")
    cols = slice(offset, offset + b.shape[1])
    keep = torch.tensor([s < 0 for s in slots], device=out.device)
    assert torch.equal(out[keep], base[keep]), "rows of slot -1 must not be touched"
    assert torch.equal(out[:, :offset], base[:, :offset]) and torch.equal(out[:, cols.stop :], base[:, cols.stop :])
    if add:
        assert_close(ref, _def_add(base, x, a_true, b_true, slots, offset), "lora_expand_ref")
    else:  # the delta alone: the definition applied to zeros
        zero = torch.zeros_like(base)
        want = torch.where(keep[:, None], base, _def_add(zero, x, a_true, b_true, slots, offset))
        assert_close(ref[:, cols], want[:, cols], "lora_expand_ref (add=False)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_lora_fused_qkv(dtype):
    """q, k and v adapters (own ranks and widths) applied into the column slices of one fused qkv output; then
    the same with one stacked shrink [S, 3R, IN] whose column slices of y (row stride 3R) feed the expands."""
    g = _gen("qkv", dtype)
    slots, q, kv, d_in, r_max = [1, 1, 1, -1, 0, 2, 0, 0, 1], 24, 8, 32, 8
    x = torch.randn(len(slots), d_in, generator=g).to(dtype)  # [T, IN]
    base = torch.randn(len(slots), q + 2 * kv, generator=g).to(dtype)  # [T, q | k | v]
    sets = [
        _adapters(ranks, r_max, d_in, n, dtype, g) for ranks, n in (([8, 2, 8], q), ([4, 4, 1], kv), ([8, 3, 5], kv))
    ]
    offsets = [0, q, q + kv]
    token_slot = torch.tensor(slots)
    x_d, base_d, token_slot = to_device(x, base, token_slot)

    want = base.clone()
    for (_, _, a_true, b_true), off in zip(sets, offsets):
        want = _def_add(want, x, a_true, b_true, slots, off)
    out = base_d.clone()
    ref = base_d.clone()
    for (a, b, _, _), off in zip(sets, offsets):
        a, b = to_device(a, b)
        add_lora(out, x_d, a, b, token_slot, offset=off)
        add_lora_ref(ref, x_d, a, b, token_slot, offset=off)
    assert_close(out, ref, "add_lora qkv")
    assert_close(ref.cpu(), want, "add_lora_ref qkv")

    stacked = to_device(torch.cat([a for a, _, _, _ in sets], dim=1))  # [S, 3R, IN]
    y = lora_shrink(x_d, stacked, token_slot)  # [T, 3R]
    out2 = base_d.clone()
    for i, ((_, b, _, _), off) in enumerate(zip(sets, offsets)):
        lora_expand(y[:, i * r_max : (i + 1) * r_max], to_device(b), token_slot, out2, off)
    assert_close(out2, ref, "stacked shrink + sliced expands")


def test_empty_batch():
    a, b = to_device(torch.randn(2, 8, 16), torch.randn(2, 24, 8))
    x, out, token_slot = to_device(torch.randn(0, 16), torch.randn(0, 24), torch.zeros(0, dtype=torch.long))
    assert lora_shrink(x, a, token_slot).shape == (0, 8)
    assert add_lora(out, x, a, b, token_slot).shape == (0, 24)


def test_ref_groups_use_slices_for_runs():
    """The CPU path's fast case: a slot whose tokens are one contiguous run is a slice (no gather/scatter)."""
    groups = dict(_slot_groups(torch.tensor([-1, 1, 1, 1, 0, 2, 0, -1])))
    assert groups[1] == slice(1, 4) and groups[2] == slice(5, 6)
    assert groups[0].tolist() == [4, 6] and set(groups) == {0, 1, 2}


def test_torch_backend_matches_definition():
    """The dispatch's CPU serving path (kernels.backend("torch")) on an interleaved bf16 batch."""
    slots, offset, a_true, b_true, x, a, b, out, token_slot = _case("prefill_mix", torch.bfloat16)
    base = out.clone()
    with kernels.backend("torch"):
        add_lora(out, x, a, b, token_slot, offset)
    assert_close(out, _def_add(base, x, a_true, b_true, slots, offset), "add_lora (torch backend)")


def test_detects_wrong_slot():
    slots, offset, a_true, b_true, x, a, b, out, token_slot = _case("decode", torch.float32)
    base = out.clone()
    add_lora(out, x, a, b, token_slot, offset)
    wrong = [0 if s == 2 else s for s in slots]  # token 0 read through slot 0 instead of 2
    with pytest.raises(AssertionError, match="mismatches"):
        assert_close(out, _def_add(base, x, a_true, b_true, wrong, offset), "add_lora")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_add_lora_bmm_matches_definition(name, dtype):
    """The CPU serving path: groups computed once (as the model runner does per step), reused across calls."""
    slots, offset, a_true, b_true, x, a, b, out, token_slot = _case(name, dtype)
    x, a, b, out, token_slot = (t.cpu() for t in (x, a, b, out, token_slot))
    groups = slot_groups(token_slot, num_slots=a.shape[0])
    # each path is taken: gathered weights (decode), all slots as stored (prefill_mix), one long run (sliced),
    # and a long run (a prefill chunk) beside decodes
    want = {
        "decode": (False, [], [0, 1, 2, 3]),
        "prefill_mix": (True, [], [0, 1]),
        "one_adapter": (False, [(0, 0, 17)], []),
        "no_adapter": (False, [], []),
        "run_and_decodes": (True, [(0, 0, 20)], [0, 1, 2]),
    }[name]
    assert (groups.dense, groups.runs, sorted(groups.slots.tolist())) == want
    base = out.clone()
    add_lora_bmm(out, x, a, b, groups, offset)
    assert_close(out, _def_add(base, x, a_true, b_true, slots, offset), f"add_lora_bmm {name}")
    keep = torch.tensor([s < 0 for s in slots])
    assert torch.equal(out[keep], base[keep])  # rows without an adapter are untouched, bit for bit
