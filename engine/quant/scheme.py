"""What a checkpoint's `quantization_config` says, as one QuantScheme, or a refusal that names the quant_method and
lists what loads. QUANTIZATION (worker-vllm's variable) may name the method too: `awq`, `gptq`, `fp8` (a 16-bit
checkpoint quantized online, engine/models/llama.py) or `compressed-tensors`; naming a method the checkpoint does
not carry is refused, since vLLM would refuse it too.

- compressed-tensors, float-quantized: fp8 weights per channel or per tensor; fp8 activations dynamic per token, or
  static per tensor; weight-only fp8 runs with dynamic activations.
- compressed-tensors, pack-quantized: int4 or int8 weights per group or per channel, symmetric or not, act-order
  "group" (a g_idx per module) included; 16-bit activations (W4A16, W8A16).
- fp8 with weight_block_size (HF's fine-grained fp8: Qwen3-FP8, DeepSeek): fp8 weights with one scale per block
  (128 x 128), activations quantized per token in groups of the block's width.
- awq (AutoAWQ's GEMM packing): int4 per group with zero points; 16-bit activations.
- gptq (AutoGPTQ, GPTQModel): int4 or int8 per group or per channel, g_idx act-order (desc_act), symmetric or not;
  16-bit activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UnsupportedModelError

SUPPORTED = (
    "compressed-tensors (fp8 float-quantized; int4/int8 pack-quantized), fp8 with weight_block_size (block-wise), "
    "awq (GEMM, 4-bit), gptq (4 or 8-bit), or a 16-bit checkpoint with QUANTIZATION=fp8"
)


@dataclass(frozen=True)
class QuantScheme:
    """How the linear weights of a checkpoint are stored. kind: "fp8" (e4m3 weights: per channel, per tensor or per
    block) or "int" (weight-only integers, 16-bit activations)."""

    kind: str  # "fp8" | "int"
    source: str  # "compressed-tensors" | "fp8" | "awq" | "gptq": which loader reads the tensors
    bits: int = 8
    # fp8: "channel" | "tensor" | "block"; int: "group" | "channel"
    strategy: str = "channel"
    group_size: int | None = None  # int "group": input channels per scale; fp8 "block": (rows, cols) in `block`
    block: tuple[int, int] | None = None
    symmetric: bool = True
    desc_act: bool = False  # gptq: g_idx orders the groups (act-order)
    zeros_minus_one: bool = False  # gptq's original format stores each zero point less one
    # fp8 activations: "token" (dynamic per token), "group" (dynamic per token and block column), "static" (one
    # scale per tensor, from the checkpoint), None (weight-only)
    activations: str | None = "token"
    ignore: tuple[str, ...] = ()  # modules left 16-bit (compressed-tensors' ignore, AWQ's modules_to_not_convert)

    def scale_dtype(self, model_dtype):
        """The dtype an int format's scales are kept in: fp16 for AWQ and GPTQ (they ship fp16 scales, kept exact
        for a bf16 model too), else the model's (compressed-tensors writes its scales in the model dtype)."""
        import torch

        return torch.float16 if self.source in ("awq", "gptq") else model_dtype


METHODS = ("fp8", "awq", "gptq", "compressed-tensors")  # QUANTIZATION's values (fp8: online, for 16-bit checkpoints)
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}  # vLLM's kernel-named methods (worker-vllm users set them)


def method_setting(setting: str | None) -> str | None:
    """QUANTIZATION as the method it names."""
    return ALIASES.get(setting, setting) if setting else None


def parse(qc: dict | None, setting: str | None = None) -> QuantScheme | None:
    """The scheme of `quantization_config` (None: a 16-bit checkpoint); `setting`: QUANTIZATION."""
    if not qc:
        if setting in ("awq", "gptq", "compressed-tensors"):
            raise UnsupportedModelError(f"QUANTIZATION={setting}, but the checkpoint has no quantization_config: "
                                        f"it is not a {setting} checkpoint")  # fmt: skip
        return None
    method = str(qc.get("quant_method", "")).lower()
    if setting in ("awq", "gptq", "compressed-tensors") and setting != method:
        raise UnsupportedModelError(f"QUANTIZATION={setting}, but the checkpoint's quant_method is {method!r}")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fine_grained_fp8(qc)
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    raise UnsupportedModelError(f"quantization_config.quant_method={method!r} is not supported; supported: {SUPPORTED}")


def _awq(qc: dict) -> QuantScheme:
    bits, group, version = (
        qc.get("bits", qc.get("w_bit")),
        qc.get("group_size", qc.get("q_group_size")),
        qc.get("version", "gemm"),
    )
    if bits != 4 or str(version).lower() != "gemm":
        raise UnsupportedModelError(f"awq: bits={bits}, version={version!r} is not supported (4-bit GEMM packing is)")
    if not qc.get("zero_point", True):
        raise UnsupportedModelError("awq: zero_point=false is not supported (AutoAWQ's GEMM checkpoints have zeros)")
    return QuantScheme("int", "awq", 4, "group" if group and group > 0 else "channel", _group(group), symmetric=False,
                       activations=None, ignore=tuple(qc.get("modules_to_not_convert") or ()))  # fmt: skip


def _gptq(qc: dict) -> QuantScheme:
    bits, group = qc.get("bits"), qc.get("group_size")
    if bits not in (4, 8):
        raise UnsupportedModelError(f"gptq: bits={bits} is not supported (4 and 8 are)")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedModelError(f"gptq: checkpoint_format={fmt!r} is not supported (gptq and gptq_v2 are)")
    return QuantScheme("int", "gptq", bits, "group" if group and group > 0 else "channel", _group(group),
                       symmetric=bool(qc.get("sym", True)), desc_act=bool(qc.get("desc_act", False)),
                       zeros_minus_one=fmt == "gptq", activations=None,
                       ignore=tuple(qc.get("modules_to_not_convert") or ()))  # fmt: skip


def _fine_grained_fp8(qc: dict) -> QuantScheme:
    block = qc.get("weight_block_size")
    if not block or len(block) != 2:
        raise UnsupportedModelError("quant_method='fp8' without weight_block_size is not supported (block-wise is)")
    if str(qc.get("activation_scheme", "dynamic")) != "dynamic":
        raise UnsupportedModelError(f"fp8: activation_scheme={qc.get('activation_scheme')!r} (dynamic is supported)")
    return QuantScheme("fp8", "fp8", 8, "block", block=(int(block[0]), int(block[1])), activations="group",
                       ignore=tuple(qc.get("modules_to_not_convert") or ()))  # fmt: skip


def _compressed_tensors(qc: dict) -> QuantScheme:
    groups = list((qc.get("config_groups") or {}).items())
    if not groups:
        raise UnsupportedModelError("compressed-tensors: no config_groups")
    schemes = {_ct_group(name, g, str(qc.get("format", ""))) for name, g in groups}
    if len(schemes) != 1:
        raise UnsupportedModelError(f"compressed-tensors: mixed schemes across config_groups {[n for n, _ in groups]} "
                                    "are not supported (one scheme for every linear is)")  # fmt: skip
    (s,) = schemes
    return QuantScheme(**{**s.__dict__, "ignore": tuple(qc.get("ignore") or ())})


def _ct_group(name: str, g: dict, fmt: str) -> QuantScheme:
    w, a = g.get("weights") or {}, g.get("input_activations")
    fmt = g.get("format") or fmt
    bad = UnsupportedModelError(f"compressed-tensors group {name!r} ({fmt}): weights {w}, activations {a} are not "
                                "supported: fp8 weights per channel or tensor with dynamic per-token or static "
                                "per-tensor fp8 activations, or int4/int8 weights per group or channel with 16-bit "
                                "activations, are")  # fmt: skip
    if w.get("type") == "float" and w.get("num_bits") == 8 and w.get("strategy") in ("channel", "tensor"):
        if a is None:
            acts = "token"  # weight-only fp8 runs as W8A8 with dynamic activations, as vLLM's fallback does
        elif a.get("type") == "float" and a.get("num_bits") == 8 and a.get("dynamic") is True:
            acts = "token"
        elif (
            a.get("type") == "float"
            and a.get("num_bits") == 8
            and not a.get("dynamic")
            and a.get("strategy") == "tensor"
        ):
            acts = "static"
        else:
            raise bad
        return QuantScheme("fp8", "compressed-tensors", 8, w["strategy"], activations=acts)
    if w.get("type") == "int" and w.get("num_bits") in (4, 8) and a is None and fmt in ("pack-quantized", ""):
        strategy, group = w.get("strategy"), w.get("group_size")
        if strategy not in ("group", "channel") or (strategy == "group" and not group):
            raise bad
        if w.get("actorder") not in (None, "static", "weight", "group", False):
            raise bad
        return QuantScheme("int", "compressed-tensors", w["num_bits"], strategy, group if strategy == "group" else None,
                           symmetric=bool(w.get("symmetric", True)), desc_act=w.get("actorder") == "group",
                           activations=None)  # fmt: skip
    raise bad


def _group(group) -> int | None:
    return int(group) if group and int(group) > 0 else None
