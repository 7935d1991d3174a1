"""Gated DeltaNet's state updates (kernels/gated_delta.py): the references equal to transformers' Qwen3-Next torch
functions, whole and split into chunks at every point (the state carried between them), on odd lengths, with grouped
value heads, and each sequence's slot untouched by the others; then the Triton kernels (interpreted on CPU, or on
DEVICE) equal to the references on a varlen batch whose slots come in no order, with slots no sequence touches."""

from __future__ import annotations

import zlib

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

import kernels
from kernels import gated_delta as gd
from kernels.gated_delta import causal_conv1d_ref, gated_delta_rule_ref, gated_rms_norm_ref
from tests.kernels.conftest import TOL, assert_close, to_device

HK, HV, DK, DV = 2, 4, 8, 6  # two value heads per key head


def inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, HK, DK, generator=g), torch.randn(n, HK, DK, generator=g)
    v = torch.randn(n, HV, DV, generator=g)
    decay = -torch.rand(n, HV, generator=g)  # log decay <= 0
    beta = torch.rand(n, HV, generator=g)
    return q, k, v, decay, beta


def hf(q, k, v, decay, beta, state=None, chunked=False):
    fn = torch_chunk_gated_delta_rule if chunked else torch_recurrent_gated_delta_rule
    kw = dict(chunk_size=4) if chunked else {}
    o, s = fn(q[None], k[None], v[None], decay[None], beta[None], initial_state=None if state is None else state[None],
              output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)  # fmt: skip
    return o[0], s[0]


@pytest.mark.parametrize("n", [1, 5, 13])
def test_one_sequence_is_transformers(n):
    q, k, v, decay, beta = inputs(n)
    init = torch.randn(HV, DK, DV)
    state = torch.stack([torch.zeros(HV, DK, DV), init.clone()])  # slot 1 starts from a saved state
    o = gated_delta_rule_ref(q, k, v, decay, beta, state, [0, n], [1])
    want_o, want_s = hf(q, k, v, decay, beta, init)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1], want_s, rtol=1e-5, atol=1e-5)
    assert torch.equal(state[0], torch.zeros(HV, DK, DV))  # the other slot is untouched
    chunk_o, chunk_s = hf(q, k, v, decay, beta, init, chunked=True)  # the chunked form GPU kernels implement
    torch.testing.assert_close(o, chunk_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[1], chunk_s, rtol=1e-4, atol=1e-4)


def test_chunks_split_at_every_point_carry_the_state():
    n = 11
    q, k, v, decay, beta = inputs(n, seed=1)
    whole_state = torch.zeros(1, HV, DK, DV)
    whole = gated_delta_rule_ref(q, k, v, decay, beta, whole_state, [0, n], [0])
    for cut in range(1, n):
        state = torch.zeros(1, HV, DK, DV)
        a = gated_delta_rule_ref(q[:cut], k[:cut], v[:cut], decay[:cut], beta[:cut], state, [0, cut], [0])
        b = gated_delta_rule_ref(q[cut:], k[cut:], v[cut:], decay[cut:], beta[cut:], state, [0, n - cut], [0])
        torch.testing.assert_close(torch.cat([a, b]), whole, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state, whole_state, rtol=1e-6, atol=1e-6)


def test_a_varlen_batch_keeps_each_slot_to_its_sequence():
    """Three sequences (a prefill chunk, two decodes) in one call, each in its slot: the same as one at a time; a
    corrupted slot changes its own sequence's output only."""
    lens, slots = [5, 1, 1], [2, 0, 3]
    q, k, v, decay, beta = inputs(sum(lens), seed=2)
    qsl = [0, 5, 6, 7]
    state = torch.randn(4, HV, DK, DV)
    before = state.clone()
    o = gated_delta_rule_ref(q, k, v, decay, beta, state, qsl, slots)
    for b, slot in enumerate(slots):
        one = before.clone()
        rows = slice(qsl[b], qsl[b + 1])
        ob = gated_delta_rule_ref(q[rows], k[rows], v[rows], decay[rows], beta[rows], one, [0, lens[b]], [slot])
        torch.testing.assert_close(o[rows], ob, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state[slot], one[slot], rtol=1e-6, atol=1e-6)
    assert torch.equal(state[1], before[1])  # no sequence's slot
    bad = before.clone()
    bad[0] += 1.0  # the second sequence's slot
    o2 = gated_delta_rule_ref(q, k, v, decay, beta, bad, qsl, slots)
    assert not torch.allclose(o2[5:6], o[5:6]) and torch.equal(o2[:5], o[:5]) and torch.equal(o2[6:], o[6:])


@pytest.mark.parametrize("n", [1, 3, 9])
def test_the_causal_conv_is_transformers_and_continues_across_chunks(n):
    c, w = 6, 4
    gen = torch.Generator().manual_seed(n)
    x, weight, bias = torch.randn(n, c, generator=gen), torch.randn(c, w, generator=gen), torch.randn(c, generator=gen)
    state = torch.zeros(1, c, w - 1)
    y = causal_conv1d_ref(x, weight, bias, state, [0, n], [0])
    want = causal_conv1d_fn(x.T[None], weight, bias, activation="silu")[0].T
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    # then one decode token through transformers' update and ours, from the state each left
    hf_state = torch.cat([torch.zeros(1, c, w - 1), x.T[None]], dim=2)[:, :, -(w - 1) :].clone()
    torch.testing.assert_close(state, hf_state)
    t = torch.randn(1, c, generator=gen)
    ours = causal_conv1d_ref(t, weight, bias, state, [0, 1], [0])
    theirs = causal_conv1d_update(t.T[None], hf_state, weight, bias, activation="silu")[0].T
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, hf_state)
    for cut in range(1, n):  # a prompt split anywhere: the same outputs
        s = torch.zeros(1, c, w - 1)
        parts = [causal_conv1d_ref(x[:cut], weight, bias, s, [0, cut], [0]),
                 causal_conv1d_ref(x[cut:], weight, bias, s, [0, n - cut], [0])]  # fmt: skip
        torch.testing.assert_close(torch.cat(parts), y, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- the Triton kernels against the references
LENS, SLOTS, POOL = [3, 1, 7, 2], [3, 0, 5, 2], 6  # slots 1 and 4: no sequence's
QSL = [0, 3, 4, 11, 13]


def _gen(*params) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _rounded_as(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """16-bit outputs: the reference's roundings, so nearly all equal (a missed rounding differs in ~25 %; the GPU's
    exp and rsqrt, a last bit off, flip a few)."""
    if expected.dtype != torch.float32:
        assert (actual != expected).float().mean() < 0.05, "not rounded where the reference rounds"


def _split(g, t, widths, dtype):
    """Views of one projection [T, sum(widths) + 3] along its last dim, as the model's splits (rows not contiguous)."""
    return (torch.randn(t, sum(widths) + 3, generator=g).to(dtype)).split([*widths, 3], dim=-1)[:-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dk,dv", [(8, 6), (256, 40)])  # 256: Dv in blocks of 16 (40: three, the last partial)
def test_gated_delta_rule_triton_is_the_reference(dk, dv, dtype):
    hk, hv, t = 2, 4, QSL[-1]
    g = _gen("gdr", dk, dv, dtype)
    q, k, v, b = _split(g, t, [hk * dk, hk * dk, hv * dv, hv], dtype)
    q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
    decay, beta = -torch.rand(t, hv, generator=g), b.sigmoid()  # fp32 log decay, beta in the model's dtype
    state = torch.randn(POOL, hv, dk, dv, generator=g)
    want_state = state.clone()
    want = gated_delta_rule_ref(q, k, v, decay, beta, want_state, QSL, SLOTS)
    q, k, v, decay, beta, state = to_device(q, k, v, decay, beta, state)
    o = gd.gated_delta_rule(q, k, v, decay, beta, state, QSL, SLOTS)
    assert o.shape == (t, hv, dv) and o.dtype == dtype
    assert_close(o.cpu(), want, "o", **(dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else TOL[dtype]))
    _rounded_as(o.cpu(), want)
    assert_close(state.cpu(), want_state, "state", atol=2e-5, rtol=2e-5)
    assert torch.equal(state.cpu()[[1, 4]], want_state[[1, 4]])  # untouched (the ref leaves them as drawn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c,bias", [(20, False), (300, True)])  # 300: two channel blocks
def test_causal_conv1d_triton_is_the_reference(c, bias, dtype):
    """Sequences of 1 and 2 rows (fewer than W - 1 = 3: the new state is the old one shifted, then the rows) beside
    longer ones, each continuing from a nonzero state."""
    w, t = 4, QSL[-1]
    g = _gen("conv", c, bias, dtype)
    (x,) = _split(g, t, [c], dtype)
    weight = torch.randn(c, w, generator=g).to(dtype)
    b = torch.randn(c, generator=g).to(dtype) if bias else None
    state = torch.randn(POOL, c, w - 1, generator=g).to(dtype)
    want_state = state.clone()
    want = causal_conv1d_ref(x, weight, b, want_state, QSL, SLOTS)
    x, weight, b, state = to_device(x, weight, b, state)
    index = (torch.tensor(QSL), torch.tensor(SLOTS)) if bias else (QSL, SLOTS)  # tensors are taken too
    y = gd.causal_conv1d(x, weight, b, state, *index)
    assert y.shape == (t, c) and y.dtype == dtype
    assert_close(y.cpu(), want, "y", **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else TOL[dtype]))
    _rounded_as(y.cpu(), want)
    assert torch.equal(state.cpu(), want_state)  # inputs moved, not computed: exact, untouched slots included


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)])
def test_gated_rms_norm_triton_is_the_reference(dtype, wdtype):
    t, hv, dv = 5, 3, 24
    g = _gen("norm", dtype, wdtype)
    x = (torch.randn(t, hv, dv, generator=g) * 2).to(dtype)
    (gate,) = _split(g, t, [hv * dv], dtype)
    gate = gate.reshape(t, hv, dv)  # a view: rows not contiguous
    weight = (torch.randn(dv, generator=g) + 1).to(wdtype)
    want = gated_rms_norm_ref(x, gate, weight, 1e-6)
    x, gate, weight = to_device(x, gate, weight)
    y = gd.gated_rms_norm(x, gate, weight, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y.cpu(), want, "y", **(dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else TOL[dtype]))
    _rounded_as(y.cpu(), want)


def test_cpu_tensors_take_the_torch_paths_by_default(monkeypatch):
    """The norm: its reference; the conv and the rule: the torch paths (equal to their references below)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a Triton launcher on the default backend's CPU path")

    for name in ("gated_delta_rule_triton", "causal_conv1d_triton", "gated_rms_norm_triton"):
        monkeypatch.setattr(gd, name, refuse)
    q, k, v, decay, beta = inputs(4)
    state = torch.zeros(2, HV, DK, DV)
    with kernels.backend("auto"):
        o = gd.gated_delta_rule(q, k, v, decay, beta, state, [0, 1, 4], [1, 0])
        y = gd.causal_conv1d(torch.randn(4, 5), torch.randn(5, 4), None, torch.zeros(2, 5, 3), [0, 4], [1])
        n = gd.gated_rms_norm(v, v, torch.ones(DV), 1e-6)
    want_state = torch.zeros(2, HV, DK, DV)
    want = gated_delta_rule_ref(q, k, v, decay, beta, want_state, [0, 1, 4], [1, 0])
    torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    assert y.shape == (4, 5)
    assert torch.equal(n, gated_rms_norm_ref(v, v, torch.ones(DV), 1e-6))


@pytest.mark.parametrize("lens", [[1], [1, 1, 1], [5, 1, 70, 1, 130], [64, 3]])
def test_the_torch_paths_are_the_references(lens):
    """kernels/gated_delta_torch.py (what CPU runs): the rule's one-token sequences batched, longer ones in 64-token
    chunks (padded, several chunks), and the conv over every sequence at once (shorter ones than its width too), each
    from its own slot in a pool whose other slots stay as they were."""
    from kernels.gated_delta_torch import causal_conv1d_torch, gated_delta_rule_torch

    q, k, v, decay, beta = inputs(sum(lens), seed=len(lens))
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    slots = [2 * i + 1 for i in range(len(lens))][::-1]  # odd slots, reversed; even ones untouched
    pool = torch.randn(2 * len(lens) + 1, HV, DK, DV, generator=torch.Generator().manual_seed(3))
    want_state, got_state = pool.clone(), pool.clone()
    want = gated_delta_rule_ref(q, k, v, decay, beta, want_state, qsl, slots)
    got = gated_delta_rule_torch(q, k, v, decay, beta, got_state, qsl, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=2e-5)
    assert torch.equal(got_state[0::2], pool[0::2])
    x, weight = torch.randn(sum(lens), 10, dtype=torch.float64).float(), torch.randn(10, 4)
    conv = torch.randn(2 * len(lens) + 1, 10, 3, generator=torch.Generator().manual_seed(4))
    want_conv, got_conv = conv.clone(), conv.clone()
    want = causal_conv1d_ref(x, weight, None, want_conv, qsl, slots)
    torch.testing.assert_close(causal_conv1d_torch(x, weight, None, got_conv, qsl, slots), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_conv, want_conv, rtol=0, atol=0)  # the saved inputs are copies
    assert torch.equal(got_conv[0::2], conv[0::2])
