"""Load a PEFT LoRA adapter folder into plain fp32 tensors, validated against the base model.

Only plain LoRA on the 7 linear projections of a decoder layer is accepted; anything that would change the forward
pass in a way the delta kernels do not compute (DoRA, biases, modules_to_save, per-module ranks, aLoRA, ...) is
refused by name rather than silently served wrong. The tensors in the file are the truth for which (layer, module)
pairs are adapted; adapter_config.json's target_modules is checked for consistency."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import InvalidRequestError
from engine.lora.source import CONFIG_FILE, WEIGHTS_FILE

if TYPE_CHECKING:
    from engine.models.spec import ModelSpec

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
SUPPORTED_MODULES = ATTN_MODULES + MLP_MODULES
# Phi-3's fused projections: B's rows split into the projections' (A is shared), so W + B A stays exact
SPLITS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an optional ".default" adapter name too)
_KEY_RE = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.default)?\.weight"
)
# Config keys whose non-default value changes the forward pass beyond W + scaling * B @ A.
_REFUSED_FLAGS = (
    "use_dora",
    "use_qalora",
    "lora_bias",
    "fan_in_fan_out",
    "alora_invocation_tokens",
    "arrow_config",
    "use_bdlora",
    "kasa_config",
    "monteclora_config",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
)


@dataclass
class LoRAAdapter:
    """Host-side adapter. The delta for module m of layer i is `scaling * (x @ A.T) @ B.T`; scaling is kept
    apart from B so the device side can choose where to fold it (and so B equals PEFT's tensor bit for bit)."""

    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)  # (A [r, in], B [out, r])
    nbytes: int = 0

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(m for _, m in self.weights)


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each supported projection."""
    h, q, kv, inter = (
        spec.hidden_size,
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.intermediate_size,
    )
    return dict(
        q_proj=(h, q),
        k_proj=(h, kv),
        v_proj=(h, kv),
        o_proj=(q, h),
        gate_proj=(h, inter),
        up_proj=(h, inter),
        down_proj=(inter, h),
        qkv_proj=(h, q + 2 * kv),
        gate_up_proj=(h, 2 * inter),
    )


def max_adapter_bytes(spec: ModelSpec, max_rank: int, dtype_bytes: int = 4) -> int:
    """The largest legitimate safetensors file: every module of every layer at max_rank in fp32, plus a header
    allowance. Used to refuse an oversized download before it starts."""
    per_layer = sum(max_rank * (i + o) for m, (i, o) in module_shapes(spec).items() if m not in SPLITS)
    return spec.num_layers * per_layer * dtype_bytes + (1 << 20)


def _bad(name: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"adapter {name!r}: {why}", field="lora")


def _check_config(cfg: dict, name: str, max_rank: int) -> tuple[int, float, object]:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _bad(name, f"peft_type {cfg.get('peft_type')!r} is not supported; only LORA")
    for key in _REFUSED_FLAGS:
        if cfg.get(key):  # None, False, {}, [] and "" are the defaults that keep plain LoRA
            raise _bad(name, f"{key}={cfg[key]!r} is not supported (plain LoRA only)")
    if cfg.get("bias", "none") != "none":
        raise _bad(name, f"bias={cfg['bias']!r} is not supported; only 'none'")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise _bad(name, f"r={r!r} must be a positive integer")
    if r > max_rank:
        raise _bad(name, f"rank r={r} is above MAX_LORA_RANK={max_rank}")
    alpha = cfg.get("lora_alpha", 8)  # PEFT's default
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _bad(name, f"lora_alpha={alpha!r} must be a number")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r  # PEFT's LoraLayer.update_layer
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        # PEFT matches a list entry as a suffix of the module path: the last component names the module.
        unknown = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(SUPPORTED_MODULES))
        if unknown:
            raise _bad(name, f"target_modules {unknown} are not supported; supported: {', '.join(SUPPORTED_MODULES)}")
    elif targets is not None and not isinstance(targets, str):
        raise _bad(name, f"target_modules={targets!r} must be a list or a regex string")
    return r, float(scaling), targets


def _targeted(targets, layer: int, parent: str, module: str) -> bool:
    if targets is None or targets == "all-linear":
        return True
    if isinstance(targets, str):  # PEFT: re.fullmatch against the module's path in the base model
        return re.fullmatch(targets, f"model.layers.{layer}.{parent}.{module}") is not None
    return module in {t.rsplit(".", 1)[-1] for t in targets}


def load_adapter(path: str | Path, spec: ModelSpec, max_rank: int, name: str) -> LoRAAdapter:
    """Parse and validate `path`/adapter_config.json + adapter_model.safetensors. Raises InvalidRequestError
    (field "lora") naming the offending setting or tensor and what was expected."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise _bad(name, f"cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(cfg, dict):
        raise _bad(name, f"{CONFIG_FILE} is not a JSON object")
    r, scaling, targets = _check_config(cfg, name, max_rank)
    shapes = module_shapes(spec)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():
                m = _KEY_RE.fullmatch(key)
                if spec.num_experts and (".experts." in key or ".block_sparse_moe." in key):
                    raise _bad(
                        name,
                        f"tensor {key!r} adapts a mixture-of-experts expert or router, which is not supported; "
                        "adapters may target the attention projections (q/k/v/o_proj) of this model",
                    )
                if m is None:
                    raise _bad(
                        name,
                        f"tensor {key!r} adapts a module this engine does not support; supported: "
                        f"{', '.join(SUPPORTED_MODULES)} in the decoder layers",
                    )
                layer, parent, module, half = int(m[1]), m[2], m[3], m[4]
                if module not in (ATTN_MODULES if parent == "self_attn" else MLP_MODULES):
                    raise _bad(
                        name,
                        f"tensor {key!r}: module {parent}.{module} is not supported; supported: "
                        f"{', '.join(SUPPORTED_MODULES)}",
                    )
                if layer >= spec.num_layers:
                    raise _bad(name, f"tensor {key!r}: layer {layer} does not exist; the model has {spec.num_layers}")
                if not _targeted(targets, layer, parent, module):
                    raise _bad(name, f"tensor {key!r} is not in target_modules={targets!r}")
                d_in, d_out = shapes[module]
                want = (r, d_in) if half == "A" else (d_out, r)  # A [r, in], B [out, r]
                got = tuple(f.get_slice(key).get_shape())  # checked before reading the data
                if got != want:
                    raise _bad(
                        name,
                        f"tensor {key!r} has shape {list(got)}; this model needs {list(want)} "
                        f"(r={r}, {module}: in={d_in}, out={d_out})",
                    )
                t = f.get_tensor(key)
                if not t.is_floating_point():
                    raise _bad(name, f"tensor {key!r} has dtype {t.dtype}; expected a float type")
                if not torch.isfinite(t).all():  # one NaN would poison every token of every request using it
                    raise _bad(name, f"tensor {key!r} holds NaN or inf values")
                halves.setdefault((layer, module), {})[half] = t.to(torch.float32).contiguous()
    except SafetensorError as e:
        raise _bad(name, f"{WEIGHTS_FILE} is corrupt: {e}") from None
    except FileNotFoundError:
        raise _bad(name, f"{WEIGHTS_FILE} is missing") from None
    if not halves:
        raise _bad(name, f"{WEIGHTS_FILE} holds no LoRA tensors")
    weights = {}
    for (layer, module), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise _bad(name, f"layer {layer} {module} has no {missing} tensor")
        if module in SPLITS:  # B [q + 2 kv, r] -> q, k, v parts, each with the shared A
            parts = SPLITS[module]
            sizes = [shapes[p][1] for p in parts]
            for part, b in zip(parts, ab["B"].split(sizes, 0)):
                weights[(layer, part)] = (ab["A"], b.contiguous())
        else:
            weights[(layer, module)] = (ab["A"], ab["B"])  # A [r, in] fp32, B [out, r] fp32
    nbytes = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in weights.values())
    return LoRAAdapter(name=name, rank=r, scaling=scaling, weights=weights, nbytes=nbytes)
