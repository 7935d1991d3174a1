"""The grammar mask (kernels/grammar_mask.py): xgrammar's kernel, through our operator and directly, against the
torch reference: banned tokens -inf in the listed rows only, every other logit untouched."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.grammar_mask import apply_bitmask_ref, apply_token_bitmask, new_bitmask
from tests.kernels.conftest import DEVICE


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("vocab", [37, 64, 100])
def test_mask_matches_reference(backend, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=g)
    mask = new_bitmask(4, vocab, torch.device("cpu"))
    mask.copy_(torch.randint(-(2**31), 2**31 - 1, mask.shape, generator=g, dtype=torch.int32))
    rows = [0, 2, 3]
    want = logits.clone()
    apply_bitmask_ref(want, mask, rows)
    got = logits.to(DEVICE)
    with kernels.backend(backend):
        apply_token_bitmask(got, mask.to(DEVICE) if DEVICE.type == "cpu" else mask, rows)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    assert torch.equal(want[1], logits[1])  # an unlisted row is untouched
    banned = want[rows].isinf()
    assert 0 < banned.sum() < banned.numel()  # the masks banned some tokens and kept others
