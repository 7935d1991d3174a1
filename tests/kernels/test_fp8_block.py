"""Block-scaled fp8 (kernels/fp8_block.py) against its torch reference through the Triton interpreter (or on
DEVICE): per-token-group activation quant byte for byte, the block GEMM with odd M, N and K not multiples of the
block, a bias; and the reference against the layout's rule (weights dequantized per block)."""

import pytest
import torch

from kernels.fp8_block import (
    fp8_block_gemm_triton,
    fp8_block_linear,
    fp8_block_linear_ref,
    quant_token_groups_ref,
    quant_token_groups_triton,
)
from tests.kernels.conftest import assert_close, to_device


def _weights(seed, n, k, block):
    g = torch.Generator().manual_seed(seed)
    wq = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.01 + 1e-3
    return wq, ws


@pytest.mark.parametrize("m, k, group", [(3, 64, 32), (5, 100, 32), (1, 128, 128)])
def test_token_group_quant_matches_reference(m, k, group):
    x = to_device(torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3)
    q, s = quant_token_groups_triton(x, group)
    rq, rs = quant_token_groups_ref(x, group)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.parametrize(
    "m, n, k, block, bias",
    [
        (1, 64, 128, (32, 32), False),
        (7, 40, 96, (32, 32), True),
        (3, 33, 100, (16, 32), True),
        (2, 64, 64, (64, 64), False),
    ],
)
def test_block_gemm_matches_reference(m, n, k, block, bias):
    wq, ws = _weights(m * n, n, k, block)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    b = torch.randn(n, generator=torch.Generator().manual_seed(1)) if bias else None
    x, wq, ws, b = to_device(x, wq, ws, b)
    got = fp8_block_linear(x, wq, ws, block, b)
    assert_close(got, fp8_block_linear_ref(x, wq, ws, block, b), "triton vs ref", atol=1e-3, rtol=1e-4)
    assert got.shape == (m, n) and got.dtype == torch.float32


def test_reference_is_the_layouts_rule():
    """Against the weights dequantized per block and activations that are exact in e4m3 (so only the weights'
    scales matter); a swapped block scale must break it."""
    block = (16, 32)
    wq, ws = _weights(3, 48, 96, block)
    pick = torch.randint(0, 7, (4, 96), generator=torch.Generator().manual_seed(4))
    x = torch.tensor([-4.0, -2, -1, 0, 1, 2, 4])[pick]  # powers of two: their per-group fp8 quantization is exact
    w = wq.float() * ws.repeat_interleave(16, 0)[:48].repeat_interleave(32, 1)[:, :96]
    torch.testing.assert_close(fp8_block_linear_ref(x, wq, ws, block), x @ w.t(), atol=1e-4, rtol=1e-5)
    bad = ws.clone()
    bad[[0, 1]] = bad[[1, 0]]
    assert not torch.allclose(fp8_block_linear_ref(x, wq, bad, block), x @ w.t(), atol=1e-3, rtol=1e-3)


def test_bf16_leading_dims():
    block = (32, 32)
    wq, ws = _weights(9, 64, 64, block)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x, wq, ws = to_device(x, wq, ws)
    y = fp8_block_linear(x, wq, ws, block)
    assert y.shape == (2, 3, 64) and y.dtype == torch.bfloat16
    assert_close(y, fp8_block_linear_ref(x, wq, ws, block))
    xq, xs = quant_token_groups_triton(x.reshape(6, 64), 32)
    assert_close(fp8_block_gemm_triton(xq, xs, wq, ws, 32, 32, None, torch.float32),
                 fp8_block_linear_ref(x, wq, ws, block, out_dtype=torch.float32).reshape(6, 64),
                 "fp32 out", atol=1e-3, rtol=1e-4)  # fmt: skip
