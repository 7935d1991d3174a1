"""Mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE, and GPT-OSS's experts (engine/models/gpt_oss.py). The Llama
family's layers with the MLP of MoE layers replaced by a router and experts run through kernels/fused_moe.py
(Triton on a GPU; on CPU one matmul pair per expert that has tokens).

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

import torch
from torch import nn

from engine.layers.dense import dense
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from kernels.activation import silu_and_mul
from kernels.fused_moe import fused_moe

FP8 = torch.float8_e4m3fn


class MoELayer(DecoderLayer):
    def __init__(self, s, dtype, device, fp8: bool, moe: bool, packed=None, mxfp4: bool = False, attention=True):
        """mxfp4: GPT-OSS's experts kept as the checkpoint packs them (engine/models/gpt_oss.py)."""
        super().__init__(s, dtype, device, fp8, mlp=not moe, packed=packed, attention=attention)
        # a block-fp8 checkpoint's experts are requantized per channel while loading (engine/quant/convert.py)
        fp8 = fp8 or (packed is not None and packed.kind == "fp8")
        self.moe = moe
        # w13 / w2 -> [E, N, 1] fp32 when the experts are fp8, [E, N, K / 32] uint8 (e8m0) when MXFP4
        self.expert_scales: dict[str, torch.Tensor] = {}
        if not moe:
            return
        kw = dict(dtype=dtype, device=device)
        e, i, h = s.num_experts, s.moe_intermediate_size, s.hidden_size
        wkw = dict(dtype=FP8, device=device) if fp8 else kw
        self.router = nn.Parameter(torch.empty(e, h, **kw), False)
        if mxfp4:  # bytes [N, K / 2] (two e2m1 codes each) and e8m0 scales [N, K / 32]; rows: gate, then up
            wkw = dict(dtype=torch.uint8, device=device)
            self.expert_scales = {"w13": torch.empty(e, 2 * i, h // 32, **wkw), "w2": torch.empty(e, h, i // 32, **wkw)}
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h // 2 if mxfp4 else h, **wkw), False)
        self.w2 = nn.Parameter(torch.empty(e, h, i // 2 if mxfp4 else i, **wkw), False)
        bias = s.expert_bias  # GPT-OSS: the router's, and each expert's gate / up and down
        self.router_bias = nn.Parameter(torch.empty(e, **kw), False) if bias else None
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * i, **kw), False) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(e, h, **kw), False) if bias else None
        if fp8:
            self.expert_scales = {n: torch.ones(*getattr(self, n).shape[:2], 1, device=device) for n in ("w13", "w2")}
        si = s.shared_expert_intermediate_size
        self.shared_gate_up = nn.Parameter(torch.empty(2 * si, h, **kw), False) if si else None
        self.shared_down = nn.Parameter(torch.empty(h, si, **kw), False) if si else None
        self.shared_gate = nn.Parameter(torch.empty(1, h, **kw), False) if si else None
        self.parts |= {"w13": {0: (0, i), 1: (i, i)}, "shared_gate_up": {0: (0, si), 1: (si, si)}}  # gate, then up

    def quant_scales(self, name: str) -> torch.Tensor | None:
        return self.expert_scales[name] if name in self.expert_scales else super().quant_scales(name)


class MoEForCausalLM(LlamaForCausalLM):
    # Mixtral's block_sparse_moe, Qwen's mlp: a router, each expert's gate / up rows stacked in w13 and its down in
    # w2 (`*`: the expert's index), and Qwen2-MoE's shared expert with its sigmoid gate
    WEIGHTS = LlamaForCausalLM.WEIGHTS | {
        "block_sparse_moe.gate": ("router", None),
        "block_sparse_moe.experts.*.w1": ("w13", 0),
        "block_sparse_moe.experts.*.w3": ("w13", 1),
        "block_sparse_moe.experts.*.w2": ("w2", None),
        "mlp.gate": ("router", None),
        "mlp.experts.*.gate_proj": ("w13", 0),
        "mlp.experts.*.up_proj": ("w13", 1),
        "mlp.experts.*.down_proj": ("w2", None),
        "mlp.shared_expert.gate_proj": ("shared_gate_up", 0),
        "mlp.shared_expert.up_proj": ("shared_gate_up", 1),
        "mlp.shared_expert.down_proj": ("shared_down", None),
        "mlp.shared_expert_gate": ("shared_gate", None),
    }

    def make_layer(self, i: int, dtype, device, fp8: bool) -> MoELayer:
        return MoELayer(self.spec, dtype, device, fp8, self.spec.is_moe(i), self.layer_quant)

    def mlp(self, i: int, layer, x, lora) -> torch.Tensor:
        if not layer.moe:
            return super().mlp(i, layer, x, lora)
        s = self.spec
        logits = dense(x, layer.router, layer.router_bias).float()  # [T, E]
        if s.swiglu:  # GPT-OSS: the softmax of the top-k logits (the same weights as renormalizing, HF's order)
            top, ids = logits.topk(s.num_experts_per_tok, dim=-1)
            weights = top.softmax(-1)
        else:
            weights, ids = logits.softmax(-1).topk(s.num_experts_per_tok, dim=-1)  # [T, K]
            if s.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        sc = layer.expert_scales
        out = fused_moe(x, layer.w13, layer.w2, weights.to(x.dtype), ids, False, sc.get("w13"), sc.get("w2"),
                        layer.w13_bias, layer.w2_bias, s.swiglu)  # fmt: skip
        if layer.shared_gate_up is not None:
            shared = dense(silu_and_mul(dense(x, layer.shared_gate_up)), layer.shared_down)
            out = out + torch.sigmoid(dense(x, layer.shared_gate)) * shared
        return self.reduce(out)  # tensor parallelism: each rank's intermediate slice of every expert, summed

    def snapshot_state(self) -> dict[str, torch.Tensor]:
        out = super().snapshot_state()
        for i, layer in enumerate(self.layers):
            for n, sc in layer.expert_scales.items():
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
