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
the per-expert names the MoE tables load (`mlp.experts.{e}.gate_proj.weight`, ...). Where the Triton kernels run
(a GPU, or the backend forced) MXFP4 experts stay 4-bit: their bytes [N, K / 2] and e8m0 scales [N, K / 32] go into
uint8 w13 / w2 and `expert_scales`, and kernels/fused_moe.py dequantizes them in its K loop (Hopper has no FP4
tensor cores); the planner counts 4.25 bits a weight. Elsewhere (CPU), or with QUANTIZATION=fp8, they are
dequantized one expert at a time into the model dtype, from where fp8 quantizes as for any checkpoint."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from engine.errors import UnsupportedModelError
from engine.models import loading
from engine.models.moe import MoEForCausalLM, MoELayer
from kernels.mxfp4 import dequantize_mxfp4_ref

log = logging.getLogger("engine")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., N, G, 16] uint8, scales [..., N, G] uint8 -> [..., N, G * 32] in `dtype` (exact: e2m1 times a
    power of two fits bf16 and fp32); kernels/mxfp4.py's reference, its error as the loader's."""
    try:
        return dequantize_mxfp4_ref(blocks, scales, dtype)
    except ValueError as e:
        raise UnsupportedModelError(str(e)) from e


def split_experts(weights: Iterator, dtype: torch.dtype, keep_mxfp4: bool = False) -> Iterator:
    """The checkpoint's stacked expert tensors (unquantized or MXFP4) as per-expert ones in Mixtral / Qwen's names,
    gate and up de-interleaved; `self_attn.sinks` as a weight; everything else as it comes. keep_mxfp4: MXFP4
    experts as their bytes (`weight`, [N, K / 2] uint8) and scales (`mx_scale`, [N, K / 32] uint8)."""
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
        if keep_mxfp4:  # [E, N, G, 16] -> [E, N, K / 2]: rows stay rows, so gate / up split as for any weight
            yield from _per_expert(module, proj, "weight", blocks.shape[0], lambda e, b=blocks: b[e].flatten(-2))
            yield from _per_expert(module, proj, "mx_scale", scales.shape[0], lambda e, s=scales: s[e])
            continue
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


def load_mx_scale(model, d: loading.Dest, t: torch.Tensor, name: str) -> int:
    """An MXFP4 expert's e8m0 scales into its rows of the layer's uint8 expert_scales."""
    owner = model.layers[d.layer]
    scales = owner.expert_scales.get(d.param)
    if scales is None or scales.dtype != torch.uint8:
        raise UnsupportedModelError(f"unexpected weight {name!r}")
    loading.copy_weight(loading.part_rows(owner, d, scales), t, name)
    return 0


class GptOssForCausalLM(MoEForCausalLM):
    WEIGHTS = MoEForCausalLM.WEIGHTS | {
        "self_attn.sinks": ("sinks", None),
        "mlp.router": ("router", None),
    }
    LOADERS = MoEForCausalLM.LOADERS | {"mx_scale": load_mx_scale}

    def __init__(self, spec, dtype, device, max_positions: int, quantization=None, shard=None, tp=None, packed=False):
        object.__setattr__(self, "mxfp4", spec.keeps_mxfp4(packed, quantization))  # before super() builds layers
        super().__init__(spec, dtype, device, max_positions, quantization, shard, tp, packed)

    def make_layer(self, i: int, dtype, device, fp8: bool) -> MoELayer:
        return MoELayer(self.spec, dtype, device, fp8, self.spec.is_moe(i), self.layer_quant, self.mxfp4)

    def load_weights(self, weights) -> None:
        if self.mxfp4:
            log.info("GPT-OSS: MXFP4 experts kept 4-bit (dequantized in the fused MoE kernel)")
        super().load_weights(split_experts(weights, self.embed.dtype, keep_mxfp4=self.mxfp4))
