"""Rotary position embedding, neox style (rotate half), with linear, Llama-3, YaRN and longrope frequency scaling."""

from __future__ import annotations

import math

import torch

from engine.errors import UnsupportedModelError
from kernels import cpu_ops
from kernels._common import use_triton
from kernels.rotary import rotary_embedding, rotary_rows, rotate_ref


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        # Same arithmetic as HF's _compute_llama3_parameters, so positions match exactly.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out)
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)[0]
    raise UnsupportedModelError(
        f"rope scaling type {kind!r} is not supported (default, linear, llama3, yarn, longrope are)"
    )


def _yarn(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN as transformers computes it (_compute_yarn_parameters): the inverse frequencies blended between
    interpolated (/ factor) and original along a linear ramp over the dimensions between the beta_fast and beta_slow
    rotation counts (floored / ceiled unless `truncate` is false: GPT-OSS), and cos/sin scaled by the attention
    factor (0.1 ln(factor) + 1 unless given). Returns (inv [head_dim / 2], attention factor)."""
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original length
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low)
    extrapolate = 1 - ramp.clamp(0, 1)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate, attn


def _longrope(head_dim: int, theta: float, scaling: dict, max_pos: int) -> torch.Tensor:
    """Phi-3's longrope as transformers computes it: per-dimension factors on the inverse frequencies, short ones
    for positions below original_max_position_embeddings and long ones from there on, and cos/sin scaled by
    sqrt(1 + ln(factor) / ln(original)). Returns freqs [max_pos, head_dim/2] (angles, already scaled: see below).
    transformers switches the whole forward to the long factors once the sequence passes the original length
    (keys cached before keep the short ones); here each position keeps its own, which is the same up to that
    length and consistent beyond it."""
    orig = scaling["original_max_position_embeddings"]
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    pos = torch.arange(max_pos, dtype=torch.float32)[:, None]
    short = pos * (1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta**shape))[None, :]
    long = pos * (1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta**shape))[None, :]
    return torch.where(pos < orig, short, long)


class RotaryCache:
    """cos/sin tables for every position, built once. apply() indexes them by position."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None, device):
        kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
        mscale = 1.0
        if kind == "longrope":
            freqs = _longrope(head_dim, theta, scaling, max_pos)  # [max_pos, head_dim/2]
            factor = (
                scaling.get("factor")
                or scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]
            )
            mscale = scaling.get("attention_factor") or (
                math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))
                if factor > 1
                else 1.0
            )
        else:
            inv = inv_frequencies(head_dim, theta, scaling)
            if kind == "yarn":
                mscale = _yarn(head_dim, theta, scaling)[1]
            freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]  # [max_pos, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        self.cos = (emb.cos() * mscale).to(device)
        self.sin = (emb.sin() * mscale).to(device)
        self._rows: tuple | None = None  # apply's last: (positions, its version, dtype, (cos rows, sin rows))

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        # q: [T, heads, head_dim], k: [T, kv_heads, head_dim], positions: [T]
        if use_triton(q):
            return rotary_embedding(q, k, self.cos, self.sin, positions)
        # the torch path (CPU): the step's cos/sin rows gathered once for every layer, not once per layer. A step's
        # positions are a tensor of its own there (graphs, which refill one buffer, take the Triton kernels); an
        # in-place change outside inference mode shows in the version counter (inference tensors have none)
        version = None if positions.is_inference() else positions._version
        last = self._rows
        if last is None or last[0] is not positions or last[1] != version or last[2] != q.dtype:
            last = self._rows = positions, version, q.dtype, rotary_rows(self.cos, self.sin, positions, q.dtype)
        c, s = last[3]
        if (lib := cpu_ops.library(q, k, c)) is not None:  # bf16, once the C op is loaded
            qr, kr = cpu_ops.rope(lib, q, c, s), cpu_ops.rope(lib, k, c, s)
            if qr is not None and kr is not None:
                return qr, kr
        return rotate_ref(q, c, s), rotate_ref(k, c, s)
