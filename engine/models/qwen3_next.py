"""Hybrid linear-attention models: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (their text models). Three Gated DeltaNet
layers for every gated full-attention layer (`ModelSpec.linear_layers`), on the Llama / MoE blocks:

- **full attention** (engine/models/llama.py, ModelSpec flags): q/k norms, rope on the first `rotary_dim` of each
  head (partial_rotary_factor), and an output gate: q_proj writes each head's query then its gate, and the
  attention's output is multiplied by sigmoid(gate) before o_proj. Only these layers keep KV in the paged pool.
- **Gated DeltaNet** (linear attention): in_proj -> q, k, v, z, b, a; a short causal depthwise conv (SiLU) over
  q, k, v; the gated delta rule with beta = sigmoid(b) and log decay g = -exp(A_log) * softplus(a + dt_bias);
  an RMSNorm gated by SiLU(z) per value head; out_proj. Per sequence it keeps a conv state and a recurrent state
  in a slot of the state pool (engine/state_cache.py), whatever the context length: a prefill chunk starts from
  the slot and leaves the state after its last token there (kernels/gated_delta.py).
- the MLP: a mixture of experts with a shared expert and its sigmoid gate (Qwen3-Next, Qwen3.5-MoE), or dense
  (Qwen3.5), on engine/models/moe.py.
- every RMSNorm but the gated one scales by (1 + w): folded into the weight as it loads (as Gemma's).

Checkpoints: Qwen3-Next stores in_proj_qkvz and in_proj_ba interleaved per key head ([q, k, v, z] of each head's
group, [b, a] likewise); Qwen3.5 stores in_proj_qkv, in_proj_z, in_proj_b, in_proj_a. Both load into one in_proj
whose rows are [q (all heads), k, v, z, b, a] (`arrange`). A Qwen3.5 vision-language checkpoint's language model
(`model.language_model.*`) loads; its vision tower and the multi-token-prediction head (`mtp.*`) are skipped."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ConfigError, UnsupportedModelError
from engine.models import loading
from engine.models.gemma import load_norm
from engine.models.moe import MoEForCausalLM, MoELayer
from engine.state_cache import scratch_state
from kernels.gated_delta import causal_conv1d, gated_delta_rule, gated_rms_norm
from kernels.rmsnorm import add_rms_norm

SKIPPED = ("model.visual.", "mtp.", "model.mtp.")


def refuse_for_hybrid(cfg, spec) -> None:
    """What a hybrid cannot run with yet, refused at start naming the setting."""
    what = f"{spec.architecture} is a hybrid (linear-attention) model:"
    if cfg.speculative_config is not None:  # a rejected draft would have to roll the recurrent state back
        raise ConfigError(
            f"{what} speculative decoding is not supported for it (its recurrent state cannot "
            "roll back a rejected draft yet); unset SPECULATIVE_CONFIG",
            field="speculative_config",
        )
    if cfg.enable_lora:  # its fused q rows carry the output gate: adapters' rows would not line up
        raise ConfigError(f"{what} LoRA is not supported for it yet; unset ENABLE_LORA", field="enable_lora")


class HybridLayer(MoELayer):
    def __init__(self, s, dtype, device, fp8: bool, moe: bool, linear: bool):
        super().__init__(s, dtype, device, fp8, moe, attention=not linear)
        self.gdn = linear  # a Gated DeltaNet layer (else full attention)
        if not linear:
            return
        la = s.linear_attn
        kd, vd, hv = la.k_heads * la.k_dim, la.v_heads * la.v_dim, la.v_heads
        lin = dict(dtype=torch.float8_e4m3fn if fp8 else dtype, device=device)
        kw = dict(dtype=dtype, device=device)
        self.in_proj = nn.Parameter(torch.empty(2 * kd + 2 * vd + 2 * hv, s.hidden_size, **lin), False)
        self.out_proj = nn.Parameter(torch.empty(s.hidden_size, vd, **lin), False)
        self.conv = nn.Parameter(torch.empty(la.conv_channels, la.conv_width, **kw), False)  # depthwise, no bias
        self.dt_bias = nn.Parameter(torch.empty(hv, **kw), False)
        self.A_log = nn.Parameter(torch.empty(hv, **kw), False)
        self.gdn_norm = nn.Parameter(torch.empty(la.v_dim, **kw), False)  # the gated norm's: not (1 + w)
        qkv = 2 * kd + vd
        self.parts["in_proj"] = {"qkv": (0, qkv), "z": (qkv, vd), "b": (qkv + vd, hv), "a": (qkv + vd + hv, hv)}
        self.LINEARS = ("in_proj", "out_proj") + self.LINEARS
        if fp8:
            for n in ("in_proj", "out_proj"):
                self.fp8_scales[n] = torch.ones(getattr(self, n).shape[0], 1, device=device)


def load_conv(model, d: loading.Dest, t: torch.Tensor, name: str) -> int:
    """conv1d.weight [C, 1, W] -> our [C, W]."""
    dst = loading.target(model, d, name)
    loading.copy_weight(dst, t.reshape(t.shape[0], -1), name)
    return dst.numel()


class HybridForCausalLM(MoEForCausalLM):
    WEIGHTS = MoEForCausalLM.WEIGHTS | {
        "linear_attn.in_proj_qkv": ("in_proj", "qkv"),
        "linear_attn.in_proj_z": ("in_proj", "z"),
        "linear_attn.in_proj_b": ("in_proj", "b"),
        "linear_attn.in_proj_a": ("in_proj", "a"),
        "linear_attn.out_proj": ("out_proj", None),
        "linear_attn.conv1d": ("conv", None),
        "linear_attn.dt_bias": ("dt_bias", None),
        "linear_attn.A_log": ("A_log", None),
        "linear_attn.norm": ("gdn_norm", None),
    }
    NORMS = ("norm", "input_norm", "post_norm", "q_norm", "k_norm")
    LOADERS = MoEForCausalLM.LOADERS | {f"{n}.weight": load_norm for n in NORMS} | {"conv.weight": load_conv}

    def __init__(self, spec, dtype, device, max_positions: int, quantization=None, shard=None, tp=None, packed=False):
        super().__init__(spec, dtype, device, max_positions, quantization, shard, tp, packed)
        if self.layer_quant is not None:
            raise UnsupportedModelError(
                f"{spec.architecture} with {spec.quant.source} weights kept in their own layout (the GPU's) is not "
                "supported yet: hybrid models load 16-bit checkpoints (QUANTIZATION=fp8 quantizes them), and quantized "
                "ones on CPU"
            )
        # layer -> its index among the linear layers (the state pool's first dimension)
        self.state_index = [sum(spec.is_linear(j) for j in range(i)) for i in range(spec.num_layers)]

    def make_layer(self, i: int, dtype, device, fp8: bool) -> HybridLayer:
        return HybridLayer(self.spec, dtype, device, fp8, self.spec.is_moe(i), self.spec.is_linear(i))

    def forward(self, input_ids, positions, kv_caches, attn, meta, lora=None, state=None) -> torch.Tensor:
        """As LlamaForCausalLM.forward; `state`: the step's StateBatch (engine/state_cache.py), None for a single
        sequence from a zero state (the fp8 KV calibration, a warm-up step)."""
        if state is None:
            state = scratch_state(self.spec, input_ids.shape[0], self.embed.dtype, input_ids.device)
        eps = self.spec.rms_norm_eps
        h = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = self.input_norm(h, residual, layer)
            if layer.gdn:
                h = self.gated_delta(i, layer, x, state)
            else:
                h = self.attention(i, layer, x, positions, kv_caches, attn, meta, lora)
            x, residual = add_rms_norm(h, residual, layer.post_norm, eps)
            h = self.mlp(i, layer, x, lora)
        return h + residual

    def gated_delta(self, i: int, layer: HybridLayer, x: torch.Tensor, state) -> torch.Tensor:
        """Layer i's Gated DeltaNet on normed x [T, hidden], each sequence from and back to its state slot."""
        la, j = self.spec.linear_attn, self.state_index[i]
        kd, vd, hv = la.k_heads * la.k_dim, la.v_heads * la.v_dim, la.v_heads
        qkv, z, b, a = layer.linear("in_proj", x).split([2 * kd + vd, vd, hv, hv], dim=-1)
        qkv = causal_conv1d(qkv, layer.conv, None, state.conv[j], state.query_start_loc, state.slots)  # [T, C]
        q, k, v = qkv.split([kd, kd, vd], dim=-1)
        t = x.shape[0]
        beta = b.sigmoid()
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)  # [T, Hv] fp32, <= 0
        o = gated_delta_rule(
            q.reshape(t, la.k_heads, la.k_dim), k.reshape(t, la.k_heads, la.k_dim), v.reshape(t, hv, la.v_dim),
            g, beta, state.rec[j], state.query_start_loc, state.slots,
        )  # fmt: skip
        o = gated_rms_norm(o, z.reshape(t, hv, la.v_dim), layer.gdn_norm, self.spec.rms_norm_eps)  # [T, Hv, Dv]
        return self.reduce(layer.linear("out_proj", o.reshape(t, vd)))  # row-parallel under TP

    def arrange(self, weights):
        """The checkpoint's names and layouts as WEIGHTS reads them: a vision-language checkpoint's language model
        under `model.`, its vision tower and the MTP head skipped; Qwen3-Next's per-key-head in_proj_qkvz / in_proj_ba
        split into our row order; dt_bias and A_log as weights; fused experts (`mlp.experts.gate_up_proj` [E, 2I, H],
        `down_proj` [E, H, I]: transformers 5's layout, Qwen3.5-MoE's) as per-expert tensors."""
        full = self.shard.spec if self.shard is not None else self.spec  # the checkpoint's shapes, not a rank's
        la = full.linear_attn
        r = la.v_heads // la.k_heads
        for name, t in weights:
            name = name.replace("model.language_model.", "model.", 1)
            if name.startswith(SKIPPED):
                continue
            module, _, suffix = name.rpartition(".")
            if suffix in ("dt_bias", "A_log"):
                yield f"{name}.weight", t
            elif module.endswith("mlp.experts") and suffix in ("gate_up_proj", "down_proj"):  # fused, [E, N, K]
                inter = full.moe_intermediate_size  # gate_up: each expert's gate rows, then its up rows
                for e in range(t.shape[0]):
                    if suffix == "down_proj":
                        yield f"{module}.{e}.down_proj.weight", t[e]
                    else:
                        yield f"{module}.{e}.gate_proj.weight", t[e, :inter]
                        yield f"{module}.{e}.up_proj.weight", t[e, inter:]
            elif module.endswith("linear_attn.in_proj_qkvz"):  # [Hk, (2 Dk + 2 r Dv)] rows
                head = t.reshape(la.k_heads, -1, *t.shape[1:])
                q, k, v, z = head.split([la.k_dim, la.k_dim, r * la.v_dim, r * la.v_dim], dim=1)
                base = module.removesuffix("qkvz")
                flat = [x.reshape(-1, *t.shape[1:]) for x in (q, k, v, z)]
                yield f"{base}qkv.{suffix}", torch.cat(flat[:3])
                yield f"{base}z.{suffix}", flat[3]
            elif module.endswith("linear_attn.in_proj_ba"):  # [Hk, 2 r] rows
                b, a = t.reshape(la.k_heads, 2 * r, *t.shape[1:]).split(r, dim=1)
                base = module.removesuffix("ba")
                yield f"{base}b.{suffix}", b.reshape(-1, *t.shape[1:])
                yield f"{base}a.{suffix}", a.reshape(-1, *t.shape[1:])
            else:
                yield name, t
