"""Rotary position embedding, neox style (rotate half): Triton kernel, launcher and torch reference.

Math (engine/layers/rotary.py RotaryCache.apply): cos/sin rows are gathered by position and cast to q.dtype,
then out = q*cos + rotate_half(q)*sin in q.dtype, i.e. each product is rounded to q.dtype and so is their
sum. The kernel makes the same roundings (_common.round_to: nearest even, also under the interpreter), so it
matches the reference bit for bit. Scaling (linear, llama3) only changes the tables.

The Triton path works IN PLACE on q and k (each program reads both halves of a head before writing them);
the public op returns (q, k) either way, so callers must use the returned tensors.
"""

from __future__ import annotations

import torch

from kernels._common import jit, next_power_of_2, round_to, tl, use_triton
from kernels._library import no_output, triton_op


@jit
def _rope_rows(base_ptr, stride_h, n_heads, c1, c2, s1, s2, half, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # Rotates [n_heads, head_dim] for one token in place. c1/c2/s1/s2: [1, BLOCK_D] fp32, already rounded
    # to the element dtype.
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (heads < n_heads) & (dims < half)
    p1 = base_ptr + heads * stride_h + dims  # first half
    p2 = p1 + half  # second half
    dt = base_ptr.dtype.element_ty
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x) = [-x2, x1]; each product rounded to dt, then the sum.
    o1 = round_to(round_to(x1 * c1, dt) + round_to(-x2 * s1, dt), dt)
    o2 = round_to(round_to(x2 * c2, dt) + round_to(x1 * s2, dt), dt)
    tl.store(p1, o1.to(dt), mask=mask)
    tl.store(p2, o2.to(dt), mask=mask)


@jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    n_q_heads,
    n_kv_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: q[t] [H, D] and k[t] [KVH, D] share one cos/sin row.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    dmask = dims < half
    dt = q_ptr.dtype.element_ty
    crow = cos_ptr + pos * stride_cos
    srow = sin_ptr + pos * stride_cos
    # table -> q.dtype (as the engine casts), then fp32 for the math
    c1 = round_to(tl.load(crow + dims, mask=dmask, other=0.0), dt)
    c2 = round_to(tl.load(crow + half + dims, mask=dmask, other=0.0), dt)
    s1 = round_to(tl.load(srow + dims, mask=dmask, other=0.0), dt)
    s2 = round_to(tl.load(srow + half + dims, mask=dmask, other=0.0), dt)
    _rope_rows(q_ptr + t * stride_qt, stride_qh, n_q_heads, c1, c2, s1, s2, half, BLOCK_HQ, BLOCK_D)
    _rope_rows(k_ptr + t * stride_kt, stride_kh, n_kv_heads, c1, c2, s1, s2, half, BLOCK_HK, BLOCK_D)


def rotary_embedding_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k; returns them."""
    _rotary(q, k, cos, sin, positions)
    return q, k


@triton_op("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor positions) -> ()", no_output)
def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    assert q.dim() == 3 and k.dim() == 3, f"q [T, H, D], k [T, KVH, D]; got {tuple(q.shape)}, {tuple(k.shape)}"
    t, n_q, d = q.shape
    assert k.shape[0] == t and k.shape[2] == d and d % 2 == 0, (tuple(q.shape), tuple(k.shape))
    assert q.dtype == k.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16), (q.dtype, k.dtype)
    assert q.stride(2) == 1 and k.stride(2) == 1, "head_dim must be contiguous"
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == d, (tuple(cos.shape), d)
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride() and cos.stride(1) == 1
    assert positions.shape == (t,) and positions.dtype in (torch.int64, torch.int32), positions.dtype
    assert positions.is_contiguous()
    if t > 0:
        _rotary_kernel[(t,)](
            q,
            k,
            cos,
            sin,
            positions,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            n_q,
            k.shape[1],
            d // 2,
            BLOCK_HQ=next_power_of_2(n_q),
            BLOCK_HK=next_power_of_2(k.shape[1]),
            BLOCK_D=next_power_of_2(d // 2),
            enable_fp_fusion=False,  # torch rounds q*cos and rot*sin separately: no fma, bit-exact on GPU
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_rows(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, ...]:
    """The cos and sin rows of `positions` in `dtype`: [T, 1, D] each (what rotary_embedding_ref multiplies by)."""
    return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)


def rotate_ref(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by rows (c, s) of rotary_rows."""
    return x * c + _rotate_half(x) * s


def rotary_embedding_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [T, H, D], k: [T, KVH, D], cos/sin: [max_pos, D] fp32, positions: [T]
    c, s = rotary_rows(cos, sin, positions, q.dtype)  # [T, 1, D]
    return rotate_ref(q, c, s), rotate_ref(k, c, s)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q_rot, k_rot). The Triton path rotates q and k in place; the reference returns new tensors."""
    if use_triton(q):
        return rotary_embedding_triton(q, k, cos, sin, positions)
    return rotary_embedding_ref(q, k, cos, sin, positions)
