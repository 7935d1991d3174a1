"""Gemma 2 and Gemma 3 (text): the Llama layers with Gemma's differences, as config flags on ModelSpec.

- RMSNorm scales by (1 + w): folded into each norm weight as it loads (w + 1, in the model dtype), so the shared
  norm kernels serve. This covers q/k norms (Gemma 3) too.
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
from engine.models import loading
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from kernels.activation import gelu_tanh_and_mul
from kernels.rmsnorm import add_rms_norm, rms_norm


def load_norm(model, d: loading.Dest, t: torch.Tensor, name: str) -> int:
    """A norm weight w, stored as 1 + w: Gemma's norms scale by (1 + w), ours by the weight."""
    dst = loading.target(model, d, name)
    loading.copy_weight(dst, t, name)
    dst.add_(1.0)
    return dst.numel()


class GemmaLayer(DecoderLayer):
    def __init__(self, s, dtype, device, fp8: bool = False, packed=None):
        super().__init__(s, dtype, device, fp8, packed=packed)
        self.pre_ffn_norm = nn.Parameter(torch.empty(s.hidden_size, dtype=dtype, device=device), False)
        self.post_ffn_norm = nn.Parameter(torch.empty(s.hidden_size, dtype=dtype, device=device), False)


class GemmaForCausalLM(LlamaForCausalLM):
    LAYER = GemmaLayer
    WEIGHTS = LlamaForCausalLM.WEIGHTS | {
        "pre_feedforward_layernorm": ("pre_ffn_norm", None),
        "post_feedforward_layernorm": ("post_ffn_norm", None),
    }
    NORMS = ("norm", "input_norm", "post_norm", "pre_ffn_norm", "post_ffn_norm", "q_norm", "k_norm")
    LOADERS = LlamaForCausalLM.LOADERS | {f"{n}.weight": load_norm for n in NORMS}
    act_and_mul = staticmethod(gelu_tanh_and_mul)

    def __init__(self, spec, dtype, device, max_positions: int, quantization=None, shard=None, tp=None, packed=False):
        super().__init__(spec, dtype, device, max_positions, quantization, shard, tp, packed)
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
