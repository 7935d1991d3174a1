"""The weight-only int GEMM (kernels/int_gemm.py) against its torch reference, through the Triton interpreter (or on
DEVICE for real), and the reference against a plain dequantize-then-matmul written here from the layout's rule:
odd M, K not a multiple of the group or of the packing, act-order permutations, zero points, split-K, 4 and 8 bits."""

import pytest
import torch

from kernels.int_gemm import int_gemm_triton, int_linear, int_linear_ref, pack, unpack
from tests.kernels.conftest import assert_close, to_device


def _case(seed, m, n, k, bits, group, zeros=True, perm=False, dtype=torch.float32):
    """Random codes, scales and zeros in the layout, the activations, and the weight they stand for [N, K] in
    the original column order (w_orig[:, perm[j]] = stored column j)."""
    g = torch.Generator().manual_seed(seed)
    ng = -(-k // group)
    q = torch.randint(0, 1 << bits, (n, k), generator=g)
    s = (torch.rand(n, ng, generator=g) * 0.05 + 0.01).to(dtype)
    z = torch.randint(0, 1 << bits, (n, ng), generator=g).to(torch.uint8) if zeros else None
    p = torch.randperm(k, generator=g) if perm else None
    x = torch.randn(m, k, generator=g).to(dtype)
    cols = torch.arange(k) // group
    zz = (1 << (bits - 1)) if z is None else z.int()[:, cols]
    w_stored = (q - zz).float() * s.float()[:, cols]  # the rule, in the stored order
    w_orig = torch.empty_like(w_stored)
    w_orig[:, p if p is not None else torch.arange(k)] = w_stored
    return x, pack(q, bits), s, z, p, w_orig


def test_pack_round_trips():
    for bits in (4, 8):
        v = torch.randint(0, 1 << bits, (5, 37))
        assert torch.equal(unpack(pack(v, bits), bits, 37), v)
    assert pack(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]]), 4).item() == int("f7654321", 16) - 2**32


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("perm", [False, True])
def test_reference_is_the_layouts_rule(bits, zeros, perm):
    x, qw, s, z, p, w = _case(1, 5, 24, 80, bits, 32, zeros, perm)
    assert_close(int_linear_ref(x, qw, s, z, p, bits, 32), x @ w.t(), "ref vs rule", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "m, n, k, bits, group, zeros, perm, split",
    [
        (1, 48, 128, 4, 32, True, False, 1),
        (7, 40, 96, 4, 32, True, True, 1),  # odd M and N, act-order
        (3, 33, 100, 4, 24, False, False, 1),  # K not a multiple of the group nor of the packing; symmetric
        (2, 64, 160, 8, 64, True, False, 1),
        (1, 48, 256, 4, 64, True, True, 3),  # split-K, act-order
        (5, 17, 72, 8, 72, False, False, 2),  # one group per channel, split-K
    ],
)
def test_triton_gemm_matches_reference(m, n, k, bits, group, zeros, perm, split):
    x, qw, s, z, p, _ = _case(m + n + k, m, n, k, bits, group, zeros, perm)
    x, qw, s, z, p = to_device(x, qw, s, z, p)
    bias = to_device(torch.randn(n, generator=torch.Generator().manual_seed(3)))
    got = int_gemm_triton(x, qw, s, z, p, bits, group, bias, split)
    assert_close(got, int_linear_ref(x, qw, s, z, p, bits, group, bias), "triton vs ref", atol=1e-4, rtol=1e-5)


def test_bf16_through_the_dispatch():
    x, qw, s, z, p, _ = _case(4, 6, 40, 128, 4, 32, True, True, dtype=torch.bfloat16)
    x, qw, s, z, p = to_device(x, qw, s, z, p)
    y = int_linear(x.reshape(2, 3, 128), qw, s, z, p, 4, 32)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    assert_close(y.reshape(6, 40), int_linear_ref(x, qw, s, z, p, 4, 32))


@pytest.mark.parametrize("break_it", ["nibble order", "swapped scales", "dropped zeros", "no perm"])
def test_each_perturbation_breaks_the_result(break_it):
    """A wrong nibble order, a swapped scale, a dropped zero point or a lost permutation must each change the
    output: the tests above could fail."""
    x, qw, s, z, p, w = _case(9, 4, 32, 128, 4, 32, True, True)
    want = x @ w.t()
    if break_it == "nibble order":  # each word's nibbles reversed
        qw = pack(unpack(qw, 4, 128).reshape(32, 16, 8).flip(-1).reshape(32, 128), 4)
    elif break_it == "swapped scales":
        s = s[:, [1, 0, 2, 3]]
    elif break_it == "dropped zeros":
        z = None
    else:
        p = None
    got = int_linear_ref(x, qw, s, z, p, 4, 32)
    assert not torch.allclose(got, want, atol=1e-3, rtol=1e-3)
