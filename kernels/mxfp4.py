"""MXFP4 (OCP microscaling FP4, GPT-OSS's expert weights): the layout, its torch dequantization and the Triton
tile decoder the GEMMs call inside their K loop (kernels/fused_moe.py), so the weights stay 4-bit in memory.

A weight [N, K] (K a multiple of 32) is stored as
- `q` uint8 [N, K // 2]: two e2m1 codes per byte along K, element 2j in the low nibble, 2j + 1 in the high one. A
  code is a sign (bit 3) and a magnitude index (bits 0-2) into (0, 0.5, 1, 1.5, 2, 3, 4, 6): `FP4_VALUES`;
- `s` uint8 [N, K // 32]: e8m0, each group of 32 consecutive K elements is multiplied by 2 ** (s - 127).

Every value is an e2m1 number times a power of two: exact in fp32 and, for the scales checkpoints carry, in bf16.
`dequantize_mxfp4_ref` also takes a checkpoint's own [..., N, G, 16] blocks (transformers' layout)."""

from __future__ import annotations

import torch

from kernels._common import jit, tl

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # K elements per e8m0 scale


def mxfp4_k(q: torch.Tensor) -> int:
    """The logical K of packed weights [..., N, K // 2]."""
    return 2 * q.shape[-1]


def dequantize_mxfp4_ref(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q uint8 [..., N, K // 2] (or [..., N, G, 16]), s uint8 [..., N, K // 32] -> [..., N, K] in `dtype`: the e2m1
    values times 2 ** (s - 127), computed in fp32 (exact) and rounded once."""
    if q.dim() == s.dim() + 1 and q.shape[-1] == 16:  # a checkpoint's blocks
        q = q.flatten(-2)
    if (
        q.dtype != torch.uint8
        or s.dtype != torch.uint8
        or q.shape[:-1] != s.shape[:-1]
        or q.shape[-1] != 16 * s.shape[-1]
    ):
        raise ValueError(f"MXFP4 weights {tuple(q.shape)} {q.dtype} do not match scales {tuple(s.shape)} {s.dtype}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=q.device)
    b = q.to(torch.int64)
    vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # [..., N, K], low nibble first
    vals = vals.unflatten(-1, (s.shape[-1], GROUP))  # [..., N, G, 32]
    out = torch.ldexp(vals, (s.to(torch.int32) - 127)[..., None].float())
    return out.flatten(-2).to(dtype)


@jit
def mxfp4_tile(q_ptr, s_ptr, offs_n, n_ok, k0, K, stride_qn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 tile [BLOCK_N, BLOCK_K] of rows offs_n, columns k0 .. k0 + BLOCK_K of an MXFP4 weight whose rows
    start at q_ptr (bytes) and s_ptr (scales); BLOCK_K a multiple of 32, k0 of BLOCK_K, K of 32. Columns past K
    (and rows not n_ok) are 0."""
    G: tl.constexpr = BLOCK_K // 32
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    q = tl.load(
        q_ptr + offs_n[:, None] * stride_qn + offs_b[None, :],
        mask=n_ok[:, None] & (offs_b < K // 2)[None, :],
        other=0,
    )  # [BLOCK_N, BLOCK_K // 2] uint8
    offs_g = k0 // 32 + tl.arange(0, G)
    s = tl.load(
        s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
        mask=n_ok[:, None] & (offs_g < K // 32)[None, :],
        other=0,
    )  # [BLOCK_N, G] uint8
    # interleave along K: byte j's low nibble is element 2j, its high nibble 2j + 1
    code = tl.reshape(tl.join(q & 0x0F, q >> 4), [BLOCK_N, BLOCK_K]).to(tl.int32)
    # e2m1 -> value: twice the magnitude is m for m = 0, 1 (0, 0.5) and (2 + mantissa) << (exponent - 1) above
    m = code & 7
    twice = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
    v = tl.where((code & 8) != 0, -0.5, 0.5) * twice.to(tl.float32)
    # e8m0 -> 2 ** (s - 127) built as fp32 bits (exact for s in 1..254; the masked 0 gives 0.0)
    scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # [BLOCK_N, G]
    w = tl.reshape(v, [BLOCK_N, G, 32]) * tl.reshape(scale, [BLOCK_N, G, 1])
    return tl.reshape(w, [BLOCK_N, BLOCK_K])
