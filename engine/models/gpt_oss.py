"""GPT-OSS (transformers' GptOssForCausalLM): the mixture-of-experts layers of engine/models/moe.py with what this
family adds, each a ModelSpec flag that the shared code reads:

- attention: biases on q/k/v and o_proj, and a learned per-head **sink**, a logit that joins each softmax's
  denominator and takes no value (every attention path takes `sinks`: engine/layers/attention.py, the C decode
  kernel, the Triton kernels); sliding (128) and full layers alternate (`layer_types`); YaRN rope.
- experts: a router with a bias, the softmax of the top-k logits, expert biases and the clamped SwiGLU
  (gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate)): kernels/fused_moe.py's `swiglu`.

The checkpoint stores each layer's experts stacked, gate and up interleaved (gate rows 0::2, up rows 1::2):
unquantized as gate_up_proj [E, H, 2I] and down_proj [E, I, H] (transposed), or as **MXFP4**:
`{proj}_blocks` [E, N, K / 32, 16] uint8 (two e2m1 values a byte, the even one in the low nibble) with
`{proj}_scales` [E, N, K / 32] uint8 (e8m0: 2 ** (s - 127), one per 32 values). `split_experts` rewrites them into
the per-expert names the MoE tables load (`mlp.experts.{e}.gate_proj.weight`, ...), dequantizing MXFP4 one expert
at a time into the model dtype, from where QUANTIZATION=fp8 quantizes as for any checkpoint. Keeping them 4-bit on a
GPU (dequantized in the fused MoE kernel's loop) is not built yet: the experts take 16 (or 8) bits of memory."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from engine.errors import UnsupportedModelError
from engine.models.moe import MoEForCausalLM

log = logging.getLogger("engine")

# e2m1 by its 4 bits: sign, 2 exponent bits, 1 mantissa bit (OCP microscaling formats, v1.0)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., N, G, 16] uint8, scales [..., N, G] uint8 -> [..., N, G * 32] in `dtype` (exact: e2m1 times a
    power of two fits bf16 and fp32)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise UnsupportedModelError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # [..., N, G, 32], low nibble first
    out = torch.ldexp(vals, (scales.to(torch.int32) - 127)[..., None].float())
    return out.flatten(-2).to(dtype)


def split_experts(weights: Iterator, dtype: torch.dtype) -> Iterator:
    """The checkpoint's stacked expert tensors (unquantized or MXFP4) as per-expert ones in Mixtral / Qwen's names,
    gate and up de-interleaved; `self_attn.sinks` as a weight; everything else as it comes."""
    pending: dict[str, torch.Tensor] = {}  # an MXFP4 tensor's blocks or scales, until the other half arrives
    said = False
    for name, t in weights:
        module, _, suffix = name.rpartition(".")
        if suffix == "sinks":
            yield f"{name}.weight", t
            continue
        if not module.endswith("mlp.experts"):
            yield name, t
            continue
        proj = suffix.removesuffix("_bias").removesuffix("_blocks").removesuffix("_scales")
        if proj not in ("gate_up_proj", "down_proj"):
            raise UnsupportedModelError(f"unexpected weight {name!r}")
        if suffix.endswith("_bias"):  # [E, N]
            yield from _per_expert(module, proj, "bias", t.shape[0], lambda e, t=t: t[e])
            continue
        if suffix == proj:  # unquantized, [E, K, N]: ours are [N, K]
            yield from _per_expert(module, proj, "weight", t.shape[0], lambda e, t=t: t[e].T)
            continue
        key = f"{module}.{proj}"
        other = pending.pop(key, None)
        if other is None:
            pending[key] = t
            continue
        blocks, scales = (t, other) if suffix.endswith("_blocks") else (other, t)
        if not said:
            log.info("GPT-OSS: MXFP4 experts dequantized to %s as they load", str(dtype).removeprefix("torch."))
            said = True
        yield from _per_expert(module, proj, "weight", blocks.shape[0],
                               lambda e, b=blocks, s=scales: dequantize_mxfp4(b[e], s[e], dtype))  # fmt: skip
    if pending:
        raise UnsupportedModelError(f"MXFP4 tensors without their other half (blocks / scales): {sorted(pending)}")


def _per_expert(module: str, proj: str, suffix: str, n: int, get) -> Iterator:
    """Expert e's rows of a stacked [E, N, ...] tensor (get(e) -> [N, ...]) under its per-expert name; gate_up's
    interleaved rows split into gate (even) and up (odd)."""
    for e in range(n):
        x = get(e)
        if proj == "down_proj":
            yield f"{module}.{e}.down_proj.{suffix}", x
        else:
            yield f"{module}.{e}.gate_proj.{suffix}", x[0::2]
            yield f"{module}.{e}.up_proj.{suffix}", x[1::2]


class GptOssForCausalLM(MoEForCausalLM):
    WEIGHTS = MoEForCausalLM.WEIGHTS | {
        "self_attn.sinks": ("sinks", None),
        "mlp.router": ("router", None),
    }

    def load_weights(self, weights) -> None:
        super().load_weights(split_experts(weights, self.embed.dtype))
