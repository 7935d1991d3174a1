"""The Llama family: Llama (incl. Llama-3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), Phi-3.

The differences are config flags, so one file covers them. Weights are fused at load time
(q/k/v into qkv, gate/up into gate_up) so each layer runs 4 GEMMs."""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModelError
from engine.layers import native_stack
from engine.layers.dense import dense, dense_silu
from engine.layers.rotary import RotaryCache
from engine.models import loading
from engine.models.spec import ModelSpec
from engine.quant import linear as quant_linear
from engine.quant.convert import Converter
from engine.quant.linear import Fp8BlockLinears, IntLinears
from kernels.activation import silu_and_mul
from kernels.fp8 import fp8_linear, quant_per_channel
from kernels.rmsnorm import add_rms_norm, rms_norm

log = logging.getLogger("engine")


class DecoderLayer(nn.Module):
    def __init__(
        self, s: ModelSpec, dtype, device, fp8: bool = False, mlp: bool = True, packed=None, attention: bool = True
    ):
        """fp8: e4m3 linears with per-channel scales; packed: a QuantScheme whose layout the linears keep
        (engine/quant/linear.py), None for 16-bit or fp8 ones. mlp False: a mixture-of-experts layer, whose MLP
        weights are the experts' (engine/models/moe.py); attention False: a hybrid's linear-attention layer, whose
        mixer is its own (engine/models/qwen3_next.py)."""
        super().__init__()
        self.LINEARS = (("qkv", "o_proj") if attention else ()) + (("gate_up", "down") if mlp else ())
        kw = dict(dtype=dtype, device=device)
        self.q_size, self.kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q_rows = 2 * self.q_size if s.attn_gate else self.q_size  # Qwen3-Next: each head's query, then its gate
        # fp8 (a quantized checkpoint, or QUANTIZATION=fp8): the linears never exist in 16 bits, so a model that
        # fits only as fp8 loads; online quantization writes each streamed tensor straight into them
        lin = dict(dtype=torch.float8_e4m3fn, device=device) if fp8 else kw
        lin = dict(dtype=dtype, device="meta") if packed is not None else lin  # shapes only: replaced below
        att = attention
        self.qkv = nn.Parameter(torch.empty(q_rows + 2 * self.kv_size, s.hidden_size, **lin), False) if att else None
        bias = att and s.attention_bias
        self.qkv_bias = nn.Parameter(torch.zeros(q_rows + 2 * self.kv_size, **kw), False) if bias else None
        self.o_proj = nn.Parameter(torch.empty(s.hidden_size, self.q_size, **lin), False) if att else None
        self.o_proj_bias = nn.Parameter(torch.empty(s.hidden_size, **kw), False) if s.o_bias else None
        # GPT-OSS: a logit per query head that joins each softmax's denominator (fp32, as the kernels read it)
        sinks = dict(dtype=torch.float32, device=device)
        self.sinks = nn.Parameter(torch.empty(s.num_heads, **sinks), False) if s.attention_sinks else None
        self.gate_up = nn.Parameter(torch.empty(2 * s.intermediate_size, s.hidden_size, **lin), False) if mlp else None
        self.down = nn.Parameter(torch.empty(s.hidden_size, s.intermediate_size, **lin), False) if mlp else None
        self.input_norm = nn.Parameter(torch.empty(s.hidden_size, **kw), False)
        self.post_norm = nn.Parameter(torch.empty(s.hidden_size, **kw), False)
        self.q_norm = nn.Parameter(torch.empty(s.head_dim, **kw), False) if att and s.qk_norm else None
        self.k_norm = nn.Parameter(torch.empty(s.head_dim, **kw), False) if att and s.qk_norm else None
        self.quant_linears = None  # a quantized checkpoint's own layout (engine/quant/linear.py)
        if packed is not None:
            shapes = {n: tuple(getattr(self, n).shape) for n in self.LINEARS}
            if packed.kind == "int":
                self.quant_linears = IntLinears(self, packed, shapes, dtype, device)
            else:
                self.quant_linears = Fp8BlockLinears(self, packed, shapes, device)
        self.fp8_scales: dict[str, torch.Tensor] = {}  # linear name -> [N, 1] fp32 when the linears are fp8
        self.input_scales: dict[str, torch.Tensor] = {}  # linear name -> [1] fp32: a static activation scale
        if fp8:  # filled from the checkpoint's weight_scale tensors, or by quantizing while loading
            self.fp8_scales = {n: torch.ones(getattr(self, n).shape[0], 1, device=device) for n in self.LINEARS}
        # fused parameter -> its parts as the checkpoint stores them: (first row, rows)
        q, kv, inter = q_rows, self.kv_size, s.intermediate_size
        self.parts = {
            "qkv": {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)},
            "gate_up": {0: (0, inter), 1: (inter, inter)},
        }

    def quant_scales(self, name: str) -> torch.Tensor | None:
        """The fp8 scales of parameter `name`, None for a 16-bit one."""
        return self.fp8_scales.get(name)

    def linear(self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant_linears is not None:
            return self.quant_linears.linear(self, name, x, bias)
        scale = self.fp8_scales.get(name)
        if scale is None:
            return dense(x, getattr(self, name), bias)
        # W8A8: per-token activation scales (or the checkpoint's static one); _scaled_mm on sm89+, dequantize on CPU
        return fp8_linear(x, getattr(self, name), scale, bias, out_dtype=x.dtype, x_scale=self.input_scales.get(name))

    def quantize_fp8(self) -> None:
        """Replace the 16-bit linear weights by e4m3 + per-output-channel scales (their memory is freed)."""
        for name in self.LINEARS:
            wq, scale = quant_per_channel(getattr(self, name).data)
            setattr(self, name, nn.Parameter(wq, False))
            self.fp8_scales[name] = scale


class LlamaForCausalLM(nn.Module):
    LAYER = DecoderLayer
    # checkpoint module -> (our parameter, its part), None: skipped (engine/models/loading.py); q/k/v and gate/up
    # are fused into one GEMM each, which Phi-3 checkpoints store already
    WEIGHTS = {
        "model.embed_tokens": ("embed", None),
        "model.norm": ("norm", None),
        "lm_head": ("lm_head", None),
        "model.rotary_emb": None,  # inv_freq in some checkpoints: ours is computed
        "self_attn.rotary_emb": None,
        "self_attn": ("attn", None),  # k_scale / v_scale: fp8 KV cache scales
        "self_attn.q_proj": ("qkv", "q"),
        "self_attn.k_proj": ("qkv", "k"),
        "self_attn.v_proj": ("qkv", "v"),
        "self_attn.qkv_proj": ("qkv", None),
        "self_attn.o_proj": ("o_proj", None),
        "self_attn.q_norm": ("q_norm", None),
        "self_attn.k_norm": ("k_norm", None),
        "mlp.gate_proj": ("gate_up", 0),
        "mlp.up_proj": ("gate_up", 1),
        "mlp.gate_up_proj": ("gate_up", None),
        "mlp.down_proj": ("down", None),
        "input_layernorm": ("input_norm", None),
        "post_attention_layernorm": ("post_norm", None),
    }
    # how: by the name's suffix (weight, bias, weight_scale, k_scale, ...), or "{param}.{suffix}" for one parameter
    LOADERS = {**loading.LOADERS, **quant_linear.LOADERS}

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device,
        max_positions: int,
        quantization: str | None = None,
        shard=None,
        tp=None,
        packed: bool = False,
    ):
        """shard, tp: under tensor parallelism (engine/parallel/rank.py), this rank's part of the checkpoint and
        its collectives; None for the whole model. packed: a quantized checkpoint keeps its own layout (the Triton
        kernels run it); else it is dequantized at load (engine/quant/convert.py)."""
        super().__init__()
        s = self.spec = spec
        q = spec.quant
        self.dense = q is not None and (q.kind == "int" or q.strategy == "block") and not packed
        # fp8 quantization while loading: QUANTIZATION=fp8 on a 16-bit checkpoint; a block-fp8 checkpoint's experts
        # (the fused MoE kernel takes per-channel scales: they arrive dequantized and are quantized again)
        requant = q is not None and q.strategy == "block" and not self.dense and bool(spec.num_experts)
        self.quantization = "fp8" if (quantization == "fp8" and q is None) or requant else None
        self.converter = Converter(q, dtype, self.dense) if q is not None else None
        kw = dict(dtype=dtype, device=device)
        self.embed = nn.Parameter(torch.empty(s.vocab_size, s.hidden_size, **kw), False)
        # per-channel fp8 linears: QUANTIZATION=fp8 on a 16-bit checkpoint, or a compressed-tensors fp8 one
        fp8 = (quantization == "fp8" and q is None) or (q is not None and q.kind == "fp8" and q.strategy != "block")
        self.layer_quant = (
            q if q is not None and (q.kind == "int" or q.strategy == "block") and not self.dense else None
        )
        self.layers = nn.ModuleList(self.make_layer(i, dtype, device, fp8) for i in range(s.num_layers))
        self.norm = nn.Parameter(torch.empty(s.hidden_size, **kw), False)
        self.lm_head = (
            self.embed if s.tie_word_embeddings else nn.Parameter(torch.empty(s.vocab_size, s.hidden_size, **kw), False)
        )
        # partial rotary (rotary_dim < head_dim): the first rotary_dim of each head turn, the rest pass
        self.rotary = RotaryCache(s.rotary_dim or s.head_dim, max_positions, s.rope_theta, s.rope_scaling, device)
        # layer -> its index in the KV pool, which a hybrid's linear layers are not in (engine/models/qwen3_next.py)
        self.kv_index = [sum(not s.is_linear(j) for j in range(i)) for i in range(s.num_layers)]
        # fp8 KV scales found in the checkpoint (self_attn.k_scale / v_scale): {layer: {"k": s, "v": s}}
        self.checkpoint_kv_scales: dict[int, dict[str, float]] = {}
        self.shard, self.tp = shard, tp
        self.kept = loading.Kept()  # which parameters are views of the weights file (CPU), bytes kept and copied
        self.generates = True  # False: the checkpoint had no LM head (an embedding model's)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor, attn, meta, lora=None
    ) -> torch.Tensor:
        """input_ids, positions: [T]. kv_caches: [layers, 2, kv_heads, blocks, block_size, head_dim].
        lora: None, or fn(layer, linear name, x, out) adding each token's adapter delta to out in place.
        Returns the final hidden states before the last norm: [T, hidden]."""
        eps = self.spec.rms_norm_eps
        h = self.embed_tokens(input_ids)  # [T, hidden]
        stack = None if lora is not None else native_stack.stack_for(self, LlamaForCausalLM, DecoderLayer)
        if stack is not None and (out := stack(h, positions, kv_caches, attn, meta)) is not None:
            return out  # CPU: every layer in one C call, the loop below's bits
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = self.input_norm(h, residual, layer)
            h = self.attention(i, layer, x, positions, kv_caches, attn, meta, lora)
            x, residual = add_rms_norm(h, residual, layer.post_norm, eps)
            h = self.mlp(i, layer, x, lora)
        return h + residual

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]; vocab-parallel under tensor parallelism (each rank holds a slice of the rows)."""
        return F.embedding(input_ids, self.embed) if self.tp is None else self.tp.embed(input_ids, self.embed)

    def reduce(self, h: torch.Tensor) -> torch.Tensor:
        """A row-parallel linear's partial sums -> the full output (tensor parallelism), else h itself."""
        return h if self.tp is None else self.tp.all_reduce(h)

    def input_norm(self, h, residual, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's input norm with the residual add fused in (the first layer has no residual yet): (x, residual)."""
        if residual is None:
            return rms_norm(h, layer.input_norm, self.spec.rms_norm_eps), h
        return add_rms_norm(h, residual, layer.input_norm, self.spec.rms_norm_eps)

    def make_layer(self, i: int, dtype, device, fp8: bool) -> DecoderLayer:
        return self.LAYER(self.spec, dtype, device, fp8, packed=self.layer_quant)

    def attention(self, i: int, layer, x, positions, kv_caches, attn, meta, lora) -> torch.Tensor:
        """Layer i's attention block on normed x [T, hidden] -> o_proj's output [T, hidden]."""
        s = self.spec
        qkv = layer.linear("qkv", x, layer.qkv_bias)  # [T, q + 2 kv]
        if lora is not None:
            lora(i, "qkv", x, qkv)
        q, k, v = qkv.split([qkv.shape[-1] - 2 * layer.kv_size, layer.kv_size, layer.kv_size], dim=-1)
        gate = None
        if s.attn_gate:  # [T, H, 2D]: each head's query, then its output gate
            q, gate = q.view(-1, s.num_heads, 2 * s.head_dim).split(s.head_dim, dim=-1)
            q = q.contiguous()
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, s.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, s.rms_norm_eps)
        q, k = self.rope(i, q, k, positions)
        kv = kv_caches[self.kv_index[i]]
        o = attn.forward(q, k, v, kv[0], kv[1], meta, i, layer.sinks)  # [T, H, D]
        o = o.reshape(-1, layer.q_size)  # [T, q]
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(-1, layer.q_size))
        h = layer.linear("o_proj", o, layer.o_proj_bias)
        if lora is not None:
            lora(i, "o_proj", o, h)
        return self.reduce(h)

    def mlp(self, i: int, layer, x, lora) -> torch.Tensor:
        """Layer i's gated MLP on normed x [T, hidden] -> [T, hidden]."""
        plain = lora is None and layer.quant_linears is None and "gate_up" not in layer.fp8_scales
        act = dense_silu(x, layer.gate_up) if plain and self.act_and_mul is silu_and_mul else None  # one call
        if act is None:
            gate_up = layer.linear("gate_up", x)  # [T, 2 * inter]
            if lora is not None:
                lora(i, "gate_up", x, gate_up)
            act = self.act_and_mul(gate_up)  # [T, inter]
        h = layer.linear("down", act)
        if lora is not None:
            lora(i, "down", act, h)
        return self.reduce(h)

    def rotary_for(self, i: int) -> RotaryCache:
        return self.rotary

    def rope(self, i: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """Layer i's rotary embedding on q [T, H, D] and k [T, KVH, D]; with partial rotary on the first rotary_dim
        of each head only (the Triton kernel turns those views in place)."""
        rd = self.spec.rotary_dim
        if not rd or rd == q.shape[-1]:
            return self.rotary_for(i).apply(q, k, positions)
        qr, kr = self.rotary_for(i).apply(q[..., :rd], k[..., :rd], positions)
        return torch.cat([qr, q[..., rd:]], -1), torch.cat([kr, k[..., rd:]], -1)

    act_and_mul = staticmethod(silu_and_mul)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.norm, self.spec.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] for the rows that sample -> [S, vocab] in fp32 (gathered to rank 0 under tensor
        # parallelism: each rank holds vocab / tp rows of the head)
        logits = dense(self.final_norm(hidden), self.lm_head).float()
        return logits if self.tp is None else self.tp.gather_logits(logits)

    # ---- weights ---------------------------------------------------------------------------
    def snapshot_state(self) -> dict[str, torch.Tensor]:
        """Our own (fused, quantized) parameters by name, for an fp8 snapshot."""
        out = {"embed": self.embed, "norm": self.norm}
        if not self.spec.tie_word_embeddings:  # a headless model's: an empty marker, read back by load_snapshot
            out["lm_head"] = self.lm_head if self.generates else self.embed.new_empty(0, self.spec.hidden_size)
        for i, layer in enumerate(self.layers):
            for name, p in layer.named_parameters():
                out[f"layers.{i}.{name}"] = p
            for name, s in layer.fp8_scales.items():
                out[f"layers.{i}.{name}.fp8_scale"] = s
        for i, kv in self.checkpoint_kv_scales.items():
            for which, v in kv.items():
                out[f"layers.{i}.{which}_scale"] = torch.tensor(v)
        return {k: v.detach().cpu() for k, v in out.items()}

    def load_snapshot(self, weights) -> None:
        """The inverse of snapshot_state: no conversion, no quantization."""
        for name, t in weights:
            parts = name.split(".")
            if parts[0] != "layers":
                if name == "lm_head" and t.shape[0] == 0:
                    self._headless()
                elif not self.kept.place(p := getattr(self, name), None, t):
                    loading.copy_weight(p, t, name)
                continue
            layer = self.layers[int(parts[1])]
            if parts[-1] == "fp8_scale":
                layer.fp8_scales[parts[2]] = t.to(self.embed.device)
            elif parts[2] in ("k_scale", "v_scale"):
                self.checkpoint_kv_scales.setdefault(int(parts[1]), {})[parts[2][0]] = float(t)
            elif not self.kept.place(p := getattr(layer, parts[2]), None, t):  # fp8 linears: the fp8 parameters
                loading.copy_weight(p, t, name)

    def load_weights(self, weights) -> None:
        """Copy HF-named tensors into our parameters as they stream in: WEIGHTS says where each goes, LOADERS how.
        Raises UnsupportedModelError for a tensor we do not know, or a parameter the checkpoint left unfilled."""
        table = self.WEIGHTS | ({"lm_head": None} if self.spec.tie_word_embeddings else {})  # tied: the embedding
        filled = Counter()  # (layer, parameter) -> elements written
        if self.converter is not None:  # a quantized checkpoint: its tensors in our layout, or dequantized
            weights = self.converter(weights)
        weights = self.arrange(weights)
        if self.shard is not None:  # tensor parallelism: this rank's rows and columns of each tensor
            weights = self.shard.weights(weights)
        for name, t in weights:
            if (d := loading.locate(name, table)) is None:
                continue
            loader = self.LOADERS.get(f"{d.param}.{d.suffix}") or self.LOADERS.get(d.suffix)
            if loader is None:
                raise UnsupportedModelError(f"unexpected weight {name!r}")
            filled[d.layer, f"{d.param}_bias" if d.suffix == "bias" else d.param] += loader(self, d, t, name)
        if not self.spec.tie_word_embeddings and filled[None, "lm_head"] == 0:
            self._headless()  # a base model's checkpoint (an embedding model's): nothing to generate with
        loading.check_complete(self, filled, table)

    def arrange(self, weights):
        """The checkpoint's (name, tensor) stream as WEIGHTS reads it: a family that renames or splits rewrites it."""
        return weights

    def _headless(self) -> None:
        """No LM head: the model serves embeddings only (engine/pooling.py); generation is refused at intake. The
        embedding matrix stands in as the head (no memory of its own), so that what computes logits regardless (the
        kernel warm-up, the CUDA graphs' capture) has the usual shapes; no request ever sees them."""
        self.lm_head = self.embed
        self.generates = False
        log.warning("the checkpoint has no lm_head: this model serves embeddings (/v1/embeddings) only")
