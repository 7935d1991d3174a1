"""Mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE. The Llama family's layers with the MLP of MoE layers
replaced by a router and experts run through kernels/fused_moe.py (Triton on a GPU; on CPU one matmul pair per
expert that has tokens).

Routing, as transformers: logits = x @ router.T; probabilities = softmax in fp32; the top-k experts per token;
renormalized to sum 1 when norm_topk_prob (Mixtral always); cast to the model dtype. Qwen2-MoE adds a shared
expert (a dense gated MLP) scaled by sigmoid(x @ shared_gate.T). Layers outside the MoE pattern (Qwen's
mlp_only_layers, decoder_sparse_step) keep the dense MLP.

Weights: each expert's gate and up rows are stacked as w13 [E, 2I, H] and its down as w2 [E, H, I], from
Mixtral's block_sparse_moe.experts.{j}.w1/w3/w2 or Qwen's mlp.experts.{j}.gate_proj/up_proj/down_proj. With
QUANTIZATION=fp8 each streamed expert tensor is quantized per output channel into e4m3 with per-expert scales
[E, N, 1] (weight-only: the kernel widens them; activations stay 16-bit). LoRA adapts the attention projections
only: an adapter for an expert MLP is refused when it is loaded."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModelError
from engine.models.llama import DecoderLayer, LlamaForCausalLM, _copy, load_into
from kernels.activation import silu_and_mul
from kernels.fused_moe import fused_moe

FP8 = torch.float8_e4m3fn
# model.layers.{i}.{block_sparse_moe|mlp}.{gate | experts.{j}.{w1|w2|w3|gate_proj|up_proj|down_proj} | shared_...}
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
)
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight")
_SHARED = re.compile(
    r"model\.layers\.(\d+)\.mlp\.(shared_expert\.(gate_proj|up_proj|down_proj)|shared_expert_gate)\.weight"
)
_W13_HALF = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}  # gate rows first, then up


class MoELayer(DecoderLayer):
    def __init__(self, s, dtype, device, fp8: bool, moe: bool):
        super().__init__(s, dtype, device, fp8, mlp=not moe)
        self.moe = moe
        if not moe:
            return
        kw = dict(dtype=dtype, device=device)
        e, i, h = s.num_experts, s.moe_intermediate_size, s.hidden_size
        wkw = dict(dtype=FP8, device=device) if fp8 else kw
        self.router = nn.Parameter(torch.empty(e, h, **kw), False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, **wkw), False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, **wkw), False)
        self.expert_scales = (
            {"w13": torch.ones(e, 2 * i, 1, device=device), "w2": torch.ones(e, h, 1, device=device)} if fp8 else {}
        )
        si = s.shared_expert_intermediate_size
        self.shared_gate_up = nn.Parameter(torch.empty(2 * si, h, **kw), False) if si else None
        self.shared_down = nn.Parameter(torch.empty(h, si, **kw), False) if si else None
        self.shared_gate = nn.Parameter(torch.empty(1, h, **kw), False) if si else None


class MoEForCausalLM(LlamaForCausalLM):
    def make_layer(self, i: int, dtype, device, fp8: bool) -> MoELayer:
        return MoELayer(self.spec, dtype, device, fp8, self.spec.is_moe(i))

    def mlp(self, i: int, layer, x, lora) -> torch.Tensor:
        if not layer.moe:
            return super().mlp(i, layer, x, lora)
        s = self.spec
        probs = F.linear(x, layer.router).float().softmax(-1)  # [T, E]
        weights, ids = probs.topk(s.num_experts_per_tok, dim=-1)  # [T, K]
        if s.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        sc = layer.expert_scales
        out = fused_moe(x, layer.w13, layer.w2, weights.to(x.dtype), ids, False, sc.get("w13"), sc.get("w2"))
        if layer.shared_gate_up is not None:
            shared = F.linear(silu_and_mul(F.linear(x, layer.shared_gate_up)), layer.shared_down)
            out = out + torch.sigmoid(F.linear(x, layer.shared_gate)) * shared
        return out

    def load_weights(self, weights) -> None:
        super().load_weights(self._experts_first(weights))
        for i, layer in enumerate(self.layers):
            if layer.moe and self._expert_rows.get(i, 0) != 3 * self.spec.num_experts:
                raise UnsupportedModelError(
                    f"checkpoint: layer {i} has {self._expert_rows.get(i, 0)} of its "
                    f"{3 * self.spec.num_experts} expert weights"
                )

    def _experts_first(self, weights):
        """Take the router, expert and shared-expert tensors out of the stream (into their stacked parameters);
        pass the rest on to the Llama loader."""
        self._expert_rows: dict[int, int] = {}
        for name, t in weights:
            if m := _EXPERT.fullmatch(name):
                i, j, kind = int(m[1]), int(m[2]), m[3]
                layer = self.layers[i]
                fp8 = self.quantization == "fp8"
                if kind in ("w2", "down_proj"):
                    load_into(layer.w2[j], layer.expert_scales["w2"][j] if fp8 else None, t, name, self.embed.dtype)
                else:
                    n = self.spec.moe_intermediate_size
                    rows = slice(_W13_HALF[kind] * n, (_W13_HALF[kind] + 1) * n)
                    sc = layer.expert_scales["w13"][j][rows] if fp8 else None
                    load_into(layer.w13[j][rows], sc, t, name, self.embed.dtype)
                self._expert_rows[i] = self._expert_rows.get(i, 0) + 1
            elif m := _ROUTER.fullmatch(name):
                _copy(self.layers[int(m[1])].router, t, name)
            elif m := _SHARED.fullmatch(name):
                layer = self.layers[int(m[1])]
                if m[3] is None:
                    _copy(layer.shared_gate, t, name)
                elif m[3] == "down_proj":
                    _copy(layer.shared_down, t, name)
                else:
                    n = self.spec.shared_expert_intermediate_size
                    _copy(layer.shared_gate_up[(0 if m[3] == "gate_proj" else n) :][:n], t, name)
            else:
                yield name, t

    def snapshot_state(self) -> dict[str, torch.Tensor]:
        out = super().snapshot_state()
        for i, layer in enumerate(self.layers):
            for n, sc in getattr(layer, "expert_scales", {}).items():
                out[f"layers.{i}.{n}.expert_scale"] = sc.detach().cpu()
        return out

    def load_snapshot(self, weights) -> None:
        def rest():
            for name, t in weights:
                if name.endswith(".expert_scale"):
                    _, i, n, _ = name.split(".")
                    self.layers[int(i)].expert_scales[n] = t.to(self.embed.device)
                else:
                    yield name, t

        super().load_snapshot(rest())
