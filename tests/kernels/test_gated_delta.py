"""Gated DeltaNet's state updates (kernels/gated_delta.py, groundwork for hybrid models): equal to transformers'
Qwen3-Next torch functions, whole and split into chunks at every point (the state carried between them), on odd
lengths, with grouped value heads, and each sequence's slot untouched by the others."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from kernels.gated_delta import causal_conv1d_ref, gated_delta_rule_ref

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
