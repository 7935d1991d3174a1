"""KV cache write (vLLM's reshape_and_cache): Triton kernel, launcher and torch reference.

Layout (engine/layers/attention.py): k, v [T, KVH, D]; k_cache, v_cache [KVH, num_blocks, block_size, D];
slot_mapping [T] int64 with slot = block_id * block_size + offset, and -1 for a padding token, which writes
nothing. An fp8 (e4m3fn) cache stores (x.float() / scale).clamp(-448, 448) with per-tensor fp32 scales; other
caches store x cast to their dtype.
"""

from __future__ import annotations

import torch

from kernels._common import FP8, FP8_MAX, jit, next_power_of_2, tl, use_triton
from kernels._library import no_output, triton_op
from kernels.fp8 import fp8e4m3_rne

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, FP8)


@jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cb,
    stride_co,
    KVH,
    D,
    BLOCK_SIZE,
    IS_FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: its [KVH, D] rows of k and v go to slot `slot` of every head's cache.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)  # int64
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]  # [BLOCK_H, 1]; int64: h * stride_ch can pass 2^31
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    # slot -1: padding, nothing is read or written. (`mask & (slot >= 0)` would be the plain spelling, but the
    # interpreter turns a tensor & scalar-bool into int64 data and then rejects it as a mask.)
    d_end = tl.where(slot >= 0, D, 0)
    mask = (h < KVH) & (d < d_end)  # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)  # [BLOCK_H, BLOCK_D]
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        # round onto the e4m3 grid before the cast: see kernels/fp8.py on the interpreter's fp8 cast
        k = fp8e4m3_rne(tl.minimum(tl.maximum(tl.div_rn(k.to(tl.float32), k_scale), -448.0), 448.0))
        v = fp8e4m3_rne(tl.minimum(tl.maximum(tl.div_rn(v.to(tl.float32), v_scale), -448.0), 448.0))
    dst = h * stride_ch + blk * stride_cb + off * stride_co + d  # [BLOCK_H, BLOCK_D]
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _scale(s: torch.Tensor | None, name: str, device: torch.device) -> torch.Tensor:
    assert s is not None, f"an fp8 cache needs {name}"
    assert s.numel() == 1 and s.dtype == torch.float32 and s.device == device, (
        f"{name} must be a 1-element fp32 tensor on {device}, got {tuple(s.shape)} {s.dtype} {s.device}"
    )
    return s.reshape(1)


def _check(k, v, k_cache, v_cache, slot_mapping) -> None:
    t, kvh, d = k.shape
    assert v.shape == k.shape and v.dtype == k.dtype, (k.shape, v.shape, k.dtype, v.dtype)
    assert k_cache.dim() == 4 and k_cache.shape[0] == kvh and k_cache.shape[3] == d, (
        f"cache {tuple(k_cache.shape)} vs k [T, {kvh}, {d}]"
    )
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert k_cache.dtype in CACHE_DTYPES, k_cache.dtype
    assert slot_mapping.shape == (t,) and slot_mapping.dtype == torch.int64, (slot_mapping.shape, slot_mapping.dtype)


@triton_op(
    "reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
    "Tensor? k_scale=None, Tensor? v_scale=None) -> ()",
    no_output,
)
def reshape_and_cache_triton(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    _check(k, v, k_cache, v_cache, slot_mapping)
    t, kvh, d = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim of k and v must be contiguous"
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride(), (k_cache.stride(), v_cache.stride())
    assert slot_mapping.is_contiguous()
    is_fp8 = k_cache.dtype == FP8
    if is_fp8:
        k_scale, v_scale = _scale(k_scale, "k_scale", k.device), _scale(v_scale, "v_scale", k.device)
    else:
        k_scale = v_scale = slot_mapping  # unused (IS_FP8=False)
    if t == 0:
        return
    _reshape_and_cache_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        kvh,
        d,
        k_cache.shape[2],
        IS_FP8=is_fp8,
        BLOCK_H=next_power_of_2(kvh),
        BLOCK_D=next_power_of_2(d),
    )


def reshape_and_cache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    _check(k, v, k_cache, v_cache, slot_mapping)
    kvh, _, _, d = k_cache.shape
    # This is also the engine's CPU write path, which never pads: filter -1 slots only when present,
    # rather than copying k and v through a boolean index on every layer of every step.
    keep = slot_mapping >= 0  # [T]
    padded = not bool(keep.all())
    slots = slot_mapping[keep] if padded else slot_mapping  # [T']
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = (x[keep] if padded else x).transpose(0, 1)  # [KVH, T', D]
        if cache.dtype == FP8:
            x = (x.float() / scale.float().reshape(())).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            # index_copy_ has no fp8 kernel on CPU: copy the bytes
            cache.view(torch.uint8).view(kvh, -1, d).index_copy_(1, slots, x.view(torch.uint8))
        else:
            cache.view(kvh, -1, d).index_copy_(1, slots, x.to(cache.dtype))


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v [T, KVH, D] into the caches [KVH, num_blocks, block_size, D] at slot_mapping [T] (in place)."""
    if use_triton(k):
        reshape_and_cache_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        reshape_and_cache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
