"""Gemma 2 and Gemma 3 (text): the Llama layers with Gemma's differences, as config flags on ModelSpec.

- RMSNorm scales by (1 + w): folded into the weights at load (w + 1, in the model dtype), so the shared norm
  kernels serve. This covers q/k norms (Gemma 3) too.
- Norms around both blocks: input -> attention -> post-attention norm -> + residual -> pre-feedforward norm ->
  MLP -> post-feedforward norm -> + residual.
- GeGLU: gelu(gate, tanh approximation) * up.
- Embeddings scaled by sqrt(hidden) (rounded to the model dtype first, as transformers does).
- Attention scale query_pre_attn_scalar ** -0.5; attention logits soft-capped (Gemma 2), final logits soft-capped
  (Gemma 2).
- Sliding window on the "sliding_attention" layers (`layer_types`; older configs: every other layer from layer 0
  for Gemma 2, all but every `sliding_window_pattern`-th for Gemma 3). Gemma 3's sliding layers use their own
  rope base (`rope_local_base_freq`, or `rope_parameters["sliding_attention"]`), its full layers the global one
  (with its scaling)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.rotary import RotaryCache
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from kernels.activation import gelu_tanh_and_mul
from kernels.rmsnorm import add_rms_norm, rms_norm


def gemma_fields(cfg: dict, arch: str) -> dict:
    """The ModelSpec fields a Gemma config sets (rope_theta and rope_scaling: the full-attention layers')."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not types:
        if arch == "Gemma2ForCausalLM":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        else:
            every = cfg.get("sliding_window_pattern", 6)
            types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:  # transformers 5: one rope per layer type
        full, local = dict(rope["full_attention"]), dict(rope.get("sliding_attention") or rope["full_attention"])
    else:
        full = {"rope_theta": cfg.get("rope_theta", rope.get("rope_theta", 10000.0)), **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq") or full["rope_theta"]}
    theta = float(full.pop("rope_theta"))
    scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
    local_theta = float(local.pop("rope_theta"))
    local_scaling = local if local.get("rope_type", local.get("type", "default")) != "default" else None
    return dict(
        gemma=True,
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope=(local_theta, local_scaling) if arch == "Gemma3ForCausalLM" else None,
        layer_types=tuple(types),  # spec.py turns them into layer_windows, as for every family
        attn_scale=cfg.get("query_pre_attn_scalar", cfg["hidden_size"] // cfg["num_attention_heads"]) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
    )


class GemmaLayer(DecoderLayer):
    def __init__(self, s, dtype, device, fp8: bool = False):
        super().__init__(s, dtype, device, fp8)
        self.pre_ffn_norm = nn.Parameter(torch.empty(s.hidden_size, dtype=dtype, device=device), False)
        self.post_ffn_norm = nn.Parameter(torch.empty(s.hidden_size, dtype=dtype, device=device), False)


class GemmaForCausalLM(LlamaForCausalLM):
    LAYER = GemmaLayer
    PLAIN_NAMES = LlamaForCausalLM.PLAIN_NAMES | {
        "pre_feedforward_layernorm": "pre_ffn_norm",
        "post_feedforward_layernorm": "post_ffn_norm",
    }
    act_and_mul = staticmethod(gelu_tanh_and_mul)

    def __init__(self, spec, dtype, device, max_positions: int, quantization: str | None = None):
        super().__init__(spec, dtype, device, max_positions, quantization)
        self.local_rotary = None
        if spec.local_rope is not None:
            self.local_rotary = RotaryCache(spec.head_dim, max_positions, *spec.local_rope, device)

    def rotary_for(self, i: int) -> RotaryCache:
        return self.local_rotary if self.local_rotary is not None and self.spec.layer_windows[i] else self.rotary

    def forward(self, input_ids, positions, kv_caches, attn, meta, lora=None) -> torch.Tensor:
        """As LlamaForCausalLM.forward, with Gemma's scaled embeddings and norms around both blocks."""
        eps = self.spec.rms_norm_eps
        h = self.embed_tokens(input_ids) * torch.tensor(self.spec.hidden_size**0.5, dtype=self.embed.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = self.input_norm(h, residual, layer)
            o = rms_norm(self.attention(i, layer, x, positions, kv_caches, attn, meta, lora), layer.post_norm, eps)
            x, residual = add_rms_norm(o, residual, layer.pre_ffn_norm, eps)
            h = rms_norm(self.mlp(i, layer, x, lora), layer.post_ffn_norm, eps)
        return h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # [S, vocab] fp32
        cap = self.spec.final_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def load_weights(self, weights) -> None:
        super().load_weights(weights)
        with torch.no_grad():  # Gemma's norms scale by (1 + w)
            self.norm.add_(1.0)
            for layer in self.layers:
                for p in (layer.input_norm, layer.post_norm, layer.pre_ffn_norm, layer.post_ffn_norm):
                    p.add_(1.0)
                if layer.q_norm is not None:
                    layer.q_norm.add_(1.0)
                    layer.k_norm.add_(1.0)
