"""What the engine needs from a model's config.json (ModelSpec), normalized across families and transformers
versions: shapes, rope, per-layer sliding windows, Gemma's flags, an fp8 checkpoint's scheme."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UnsupportedModelError
from engine.quant import scheme
from engine.quant.scheme import QuantScheme

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
)
# a vision-language checkpoint whose text model we serve (its vision tower is not loaded: images are refused)
_TEXT_OF = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
HYBRIDS = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
# a family's base model (AutoModel's class, no LM head: how embedding models such as Qwen3-Embedding ship) loads as
# its causal LM without a head (engine/models/llama.py _headless)
_BASE = {a.replace("ForCausalLM", "Model"): a for a in ARCHITECTURES} | _TEXT_OF


@dataclass(frozen=True)
class GatedDeltaShape:
    """A Gated DeltaNet layer's shapes (engine/models/qwen3_next.py): key / value heads and their dims, the short
    conv's width. Per sequence it keeps a conv state [conv_channels, conv_width - 1] (model dtype) and a recurrent
    state [v_heads, k_dim, v_dim] (fp32), whatever the context length."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_width: int

    @property
    def conv_channels(self) -> int:  # q, k and v go through the conv
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def state_bytes(self, dtype_bytes: int) -> int:
        """One sequence's state in one layer."""
        return self.conv_channels * (self.conv_width - 1) * dtype_bytes + self.v_heads * self.k_dim * self.v_dim * 4

    def params(self, hidden: int) -> int:
        """in_proj (q, k, v, z, b, a), the conv, dt_bias, A_log, the gated norm and out_proj."""
        kd, vd = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        in_rows = 2 * kd + 2 * vd + 2 * self.v_heads
        return in_rows * hidden + self.conv_channels * self.conv_width + 2 * self.v_heads + self.v_dim + vd * hidden


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs from config.json, normalized across transformers versions."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    quant: QuantScheme | None = None  # how the checkpoint's linear weights are quantized (engine/quant/scheme.py)
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None for full attention
    # Gemma (engine/models/gemma.py): (1 + w) norms, norms around attention and MLP, GeGLU, scaled embeddings,
    # query_pre_attn_scalar, soft-caps, and (Gemma 3) its own rope for the sliding layers
    gemma: bool = False
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope: tuple[float, dict | None] | None = None  # (theta, scaling) of the sliding layers
    # mixture of experts (engine/models/moe.py): per MoE layer a router, num_experts gated MLPs of
    # moe_intermediate_size, top-k of them per token, and (Qwen2-MoE) a shared expert with a sigmoid gate
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k probabilities (Mixtral always)
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    # GPT-OSS (engine/models/gpt_oss.py): per-head attention sinks, an o_proj bias, a router bias, expert biases,
    # top-k before the softmax, the clamped SwiGLU (alpha, limit), and MXFP4 experts dequantized at load
    attention_sinks: bool = False
    o_bias: bool = False
    expert_bias: bool = False
    swiglu: tuple[float, float] | None = None
    mxfp4: bool = False
    # hybrid linear attention (Qwen3-Next, Qwen3.5: engine/models/qwen3_next.py): per layer True for a Gated
    # DeltaNet layer (a fixed-size state per sequence, engine/state_cache.py), the rest attending over the paged KV
    # cache with an output gate (attn_gate) and rope on the first rotary_dim of each head
    linear_layers: tuple[bool, ...] = ()
    linear_attn: GatedDeltaShape | None = None
    attn_gate: bool = False
    rotary_dim: int = 0  # 0: all of head_dim

    @property
    def hybrid(self) -> bool:
        return any(self.linear_layers)

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep KV in the paged pool (a hybrid's linear layers keep a state instead)."""
        return self.num_layers - sum(self.linear_layers)

    def state_bytes_per_seq(self, dtype_bytes: int) -> int:
        """A hybrid's per-sequence state over all its linear layers (0 for other models)."""
        la = self.linear_attn
        return sum(self.linear_layers) * la.state_bytes(dtype_bytes) if la is not None else 0

    def num_active_params(self) -> int:
        """Parameters one token runs through: all of them, less the experts its router did not pick."""
        idle = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.num_params() - idle * sum(self.is_moe(i) for i in range(self.num_layers))

    def keeps_mxfp4(self, packed: bool, quantization: str | None) -> bool:
        """GPT-OSS's MXFP4 experts stay 4-bit where the Triton kernels run (packed), unless fp8 was asked for."""
        return self.mxfp4 and packed and quantization != "fp8"

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def num_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + (4 if self.gemma else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        attn += (q + 2 * kv) if self.attention_bias else 0
        attn += (h if self.o_bias else 0) + (self.num_heads if self.attention_sinks else 0)
        attn += h * q if self.attn_gate else 0  # q_proj's gate rows
        dense = 3 * h * self.intermediate_size
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # experts and the router's rows
        moe += self.num_experts * (2 * self.moe_intermediate_size + h + 1) if self.expert_bias else 0
        moe += (3 * h * self.shared_expert_intermediate_size + h) if self.shared_expert_intermediate_size else 0
        mlps = sum(moe if self.is_moe(i) else dense for i in range(self.num_layers))
        embeds = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        linear = sum(self.linear_layers)
        mixers = (self.num_layers - linear) * attn
        if linear:  # a Gated DeltaNet layer's own weights, and its two norms
            mixers += linear * (self.linear_attn.params(h) + 2 * h)
        return mixers + mlps + embeds + h

    @property
    def prequantized(self) -> bool:
        """The checkpoint's linears are quantized already (nothing is quantized online, no fp8 snapshot)."""
        return self.quant is not None

    @property
    def fp8_checkpoint(self) -> bool:
        """Its linears are fp8 (per channel, per tensor or per block): a GPU below sm89 cannot run them."""
        return self.quant is not None and self.quant.kind == "fp8"

    @classmethod
    def from_hf(cls, cfg: dict, generation_cfg: dict | None = None, quantization: str | None = None) -> ModelSpec:
        """quantization: QUANTIZATION, checked against the checkpoint's quantization_config."""
        archs = cfg.get("architectures") or []
        if any(a in _TEXT_OF for a in archs) and "text_config" in cfg:  # the language model's own config
            tie = cfg.get("tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings"))
            top = {k: cfg[k] for k in ("quantization_config", "torch_dtype", "dtype") if k in cfg}  # the checkpoint's
            cfg = {**cfg["text_config"], **top, "architectures": archs, "tie_word_embeddings": tie}
        arch = next((_BASE.get(a, a) for a in archs if _BASE.get(a, a) in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architectures {archs} not supported; this engine runs {', '.join(ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        # transformers 5 writes rope_parameters; 4.x writes rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = []
        for src in (generation_cfg or {}, cfg):
            e = src.get("eos_token_id")
            eos += e if isinstance(e, list) else ([e] if e is not None else [])
        if scaling and (scaling.get("rope_type") or scaling.get("type")) == "yarn":  # its factor may be implied
            scaling = {**scaling, "max_position_embeddings": cfg.get("max_position_embeddings")}
        if scaling and (scaling.get("rope_type") or scaling.get("type")) == "longrope":  # Phi-3: lengths it needs
            orig = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
            scaling = {**scaling, "original_max_position_embeddings": orig}
            scaling["max_position_embeddings"] = cfg.get("max_position_embeddings", orig)
        partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or cfg.get("partial_rotary_factor")
        partial = partial or (0.25 if arch in HYBRIDS else None)  # transformers' default for them
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if partial not in (None, 1, 1.0) and arch not in HYBRIDS:
            raise UnsupportedModelError(f"{arch}: partial_rotary_factor={partial} is not supported (1.0 is)")
        extra = _hybrid_fields(cfg, head_dim, partial) if arch in HYBRIDS else {}
        if arch.startswith("Gemma"):
            extra = _gemma_fields(cfg, arch)
            theta, scaling = extra.pop("rope_theta"), extra.pop("rope_scaling")
        types = extra.pop("layer_types", cfg.get("layer_types"))  # Gemma's, derived for older configs
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0,  # Qwen3.5-MoE has no dense MLP
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(cfg, arch),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", *HYBRIDS),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            quant=_quant(cfg, arch, quantization),
            layer_windows=_layer_windows(cfg | {"layer_types": types}, arch),
            **_moe_fields(cfg, arch),
            **extra,
        )


def _attention_bias(cfg: dict, arch: str) -> bool:
    """q/k/v biases: Qwen2-MoE's modeling reads qkv_bias (its config carries an unused attention_bias too); the
    others attention_bias, which Qwen2 configs may omit (Qwen2 has biases)."""
    key = "qkv_bias" if arch == "Qwen2MoeForCausalLM" else "attention_bias"
    return bool(cfg[key]) if cfg.get(key) is not None else arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")


def _gpt_oss_fields(cfg: dict) -> dict:
    """GPT-OSS: every layer routes over num_local_experts experts of intermediate_size (softmax over the top-k
    logits, which is the renormalized top-k of the full softmax), with biases everywhere and sinks."""
    return dict(
        num_experts=cfg["num_local_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=True,
        moe_layers=(True,) * cfg["num_hidden_layers"],
        attention_sinks=True,
        o_bias=bool(cfg.get("attention_bias", True)),
        expert_bias=True,
        swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))),
        mxfp4=str((cfg.get("quantization_config") or {}).get("quant_method", "")).lower() == "mxfp4",
    )


def _hybrid_fields(cfg: dict, head_dim: int, partial) -> dict:
    """Qwen3-Next / Qwen3.5: `layer_types` (or every full_attention_interval-th layer) attend with an output gate and
    rope on partial_rotary_factor of each head; the others are Gated DeltaNet layers."""
    n = cfg["num_hidden_layers"]
    every = cfg.get("full_attention_interval", 4)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)
    ]
    shape = GatedDeltaShape(
        k_heads=cfg["linear_num_key_heads"],
        v_heads=cfg["linear_num_value_heads"],
        k_dim=cfg["linear_key_head_dim"],
        v_dim=cfg["linear_value_head_dim"],
        conv_width=cfg["linear_conv_kernel_dim"],
    )
    if shape.v_heads % shape.k_heads:
        raise UnsupportedModelError(f"{cfg['architectures']}: {shape.v_heads} linear value heads, not a multiple of "
                                    f"{shape.k_heads} key heads")  # fmt: skip
    return dict(
        linear_layers=tuple(t == "linear_attention" for t in types),
        linear_attn=shape,
        attn_gate=True,
        rotary_dim=int(head_dim * (partial or 1.0)),
    )


def _moe_fields(cfg: dict, arch: str) -> dict:
    """Mixtral: every layer routes over num_local_experts experts of intermediate_size, top-k renormalized.
    Qwen2/3-MoE: num_experts (transformers 5 writes num_local_experts) of moe_intermediate_size on the layers
    that are not in mlp_only_layers and fall on decoder_sparse_step; the rest keep a dense MLP."""
    n = cfg["num_hidden_layers"]
    if arch == "GptOssForCausalLM":
        return _gpt_oss_fields(cfg)
    if arch == "MixtralForCausalLM":
        e = cfg["num_local_experts"]
        return dict(
            num_experts=e,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=True,
            moe_layers=(True,) * n,
        )
    if arch == "Qwen3_5MoeForCausalLM":  # every layer routes, the top-k always renormalized
        return dict(
            num_experts=cfg["num_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=True,
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
            moe_layers=(True,) * n,
        )
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"):
        e = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
        return dict(
            num_experts=e,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", arch == "Qwen3NextForCausalLM")),  # transformers' defaults
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
            moe_layers=tuple(e > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)),
        )
    return {}


def _gemma_fields(cfg: dict, arch: str) -> dict:
    """The ModelSpec fields a Gemma config sets (rope_theta and rope_scaling: the full-attention layers'). Older
    configs have no layer_types: Gemma 2 slides on every other layer from layer 0, Gemma 3 on all but every
    sliding_window_pattern-th."""
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


def _layer_windows(cfg: dict, arch: str) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers applies it: `layer_types` ("sliding_attention" layers get
    `sliding_window`) where the config has them; else Mistral's `sliding_window` on every layer, and Qwen2's
    `use_sliding_window` from layer `max_window_layers` on."""
    n, w = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if not w:
        return (None,) * n
    if cfg.get("layer_types"):
        return tuple(w if t == "sliding_attention" else None for t in cfg["layer_types"])
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return (w,) * n
    if cfg.get("use_sliding_window"):
        first = cfg.get("max_window_layers", n)
        return tuple(w if i >= first else None for i in range(n))
    return (None,) * n


def _quant(cfg: dict, arch: str, setting: str | None) -> QuantScheme | None:
    qc = cfg.get("quantization_config")
    if arch == "GptOssForCausalLM" and str((qc or {}).get("quant_method", "")).lower() == "mxfp4":
        qc = None  # its MXFP4 experts are dequantized as they load (engine/models/gpt_oss.py); the rest is 16-bit
    q = scheme.parse(qc, scheme.method_setting(setting))
    moe = arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
                   "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")  # fmt: skip
    if q is not None and q.kind == "int" and moe:
        raise UnsupportedModelError(f"{arch} with {q.source} int{q.bits} weights: quantized mixture-of-experts "
                                    "experts are not supported yet in int formats (fp8 ones are)")  # fmt: skip
    return q
