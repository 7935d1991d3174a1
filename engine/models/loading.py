"""Checkpoint tensors into our parameters, by table (nano-vllm's packed_modules_mapping plus per-parameter loaders).

A model class declares two tables:
- WEIGHTS: checkpoint module -> (our parameter, part), or None for a tensor we skip. Inside a layer the module is
  named after `model.layers.{i}.`, with a stacked expert's index written `*` (`mlp.experts.*.gate_proj`); the
  model's own tensors by their full module name (`model.embed_tokens`). `part` is a key of the layer's `parts`
  (the rows of a fused parameter that module fills: q, k, v of qkv; 0, 1 of gate_up), None for all of it.
- LOADERS: `{parameter}.{suffix}` or `{suffix}` -> loader; the last component of the checkpoint name (weight,
  bias, weight_scale, k_scale, ...) picks it, a parameter's own loader first.

Tensors arrive in file order (engine/weights/reader.py) and each is written, and with QUANTIZATION=fp8 quantized,
as it arrives, so the checkpoint is never held twice. On CPU a tensor whose bytes already lie in the file as our
parameter holds them is not copied at all: the parameter becomes a view of the file's map (`Kept`)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import UnsupportedModelError
from engine.weights.reader import mapped
from kernels.fp8 import quant_per_channel

OPTIONAL = {"qkv_bias"}  # zeros unless the checkpoint has them; every other parameter must be filled whole
_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.(.+)")  # a base model's checkpoint (AutoModel's) has no "model."
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)(\..*)")


@dataclass(frozen=True)
class Dest:
    """Where one checkpoint tensor goes: rows `part` of expert `expert` of parameter `param` of layer `layer`
    (None: the model's own embed / norm / lm_head); `suffix` is the checkpoint name's last component."""

    layer: int | None
    param: str
    part: str | int | None
    expert: int | None
    suffix: str


# (model, dest, tensor, checkpoint name) -> parameter elements filled (0 for scales), for the completeness check
Loader = Callable[[torch.nn.Module, Dest, torch.Tensor, str], int]


def locate(name: str, table: dict) -> Dest | None:
    """model.layers.{i}.{module}.{suffix} or {module}.{suffix} -> its Dest through `table`; None: skipped."""
    (module, _, suffix), layer, expert = name.rpartition("."), None, None
    if m := _LAYER.fullmatch(module):
        layer, module = int(m[1]), m[2]
        if m := _EXPERT.fullmatch(module):
            module, expert = f"{m[1]}.*{m[3]}", int(m[2])
    elif module not in table and f"model.{module}" in table:  # a base model's embed_tokens, norm
        module = f"model.{module}"
    if module not in table:
        raise UnsupportedModelError(f"unexpected weight {name!r}")
    row = table[module]
    return None if row is None else Dest(layer, *row, expert, suffix)


def load_weight(model, d: Dest, t: torch.Tensor, name: str) -> int:
    """A weight, kept in place (Kept.place) or copied; with QUANTIZATION=fp8 a linear or expert weight is quantized
    per output channel as it streams in, from the model dtype (rows are independent, so this equals quantizing
    the fused 16-bit weight)."""
    owner = _owner(model, d)
    scales = owner.quant_scales(d.param) if d.layer is not None and model.quantization == "fp8" else None
    if scales is None and d.expert is None:
        rows = None if d.part is None else owner.parts[d.param][d.part]
        if model.kept.place(_param(owner, d.param, name), rows, t):
            return t.numel()
    dst = target(model, d, name)  # after place(): it may have given the parameter new memory
    load_into(dst, None if scales is None else part_rows(owner, d, scales), t, name, model.embed.dtype)
    return dst.numel()


_ALIGN = 64  # bytes: a GEMM over an 8-byte-aligned weight ran up to 16 % slower here (lm_head, one token)


class Kept:
    """The parameters that are views of a weights file's map (engine/weights/reader.py `mapped`) rather than
    copies: a tensor whose bytes lie as our parameter holds them, 64-byte aligned, becomes the parameter (no
    fault-in of fresh memory, no copy: on this VM a first touch of anonymous memory costs more than the copy).
    A fused parameter (q, k, v) is kept when its parts lie one after the other in its row order: the first part
    to arrive, at row 0, makes the parameter a view over the bytes from there; each later part is checked to be
    where that view says, and the first one that is not makes the parameter a copy again (its rows so far copied
    with it). Files laid out this way: the converted default model, fp8 snapshots (engine/weights/layout.py)."""

    def __init__(self):
        self.views: set[int] = set()  # id() of each parameter that is a view now
        self.copied: set[int] = set()  # id() of each parameter something was copied into
        self.kept_bytes = self.copied_bytes = 0

    def place(self, param: torch.Tensor, rows: tuple[int, int] | None, t: torch.Tensor) -> bool:
        """Tensor t fills `rows` (first row, count; None: all) of `param`. True: it is already there (param is a
        view of t's bytes); False: the caller copies it (and param is a fresh tensor)."""
        if param.dim() == 0:
            return False
        first, count = rows or (0, param.shape[0])
        nbytes = t.numel() * t.element_size()
        row_bytes = param.stride(0) * param.element_size()
        start = t.data_ptr() - first * row_bytes  # where the parameter's bytes begin if t lies as a part of it
        ok = (
            t.dtype == param.dtype
            and t.is_contiguous()
            and tuple(t.shape) == (count, *param.shape[1:])
            and t.device.type == "cpu"
            and mapped(t)
        )
        key = id(param)
        if key in self.views:
            if ok and param.data_ptr() == start:
                self.kept_bytes += nbytes
                return True
            self.views.discard(key)  # not where the view says: the parameter becomes a copy, rows so far too
            param.data = param.data.clone()
        elif ok and key not in self.copied and first == 0 and start % _ALIGN == 0:
            storage = t.untyped_storage()  # the whole file's map
            offset = start - storage.data_ptr()
            if offset + param.numel() * param.element_size() <= storage.nbytes():
                param.data = torch.empty(0, dtype=param.dtype).set_(
                    storage, offset // param.element_size(), param.shape, param.stride()
                )
                self.views.add(key)
                self.kept_bytes += nbytes
                return True
        self.copied.add(key)
        self.copied_bytes += nbytes
        return False


def load_bias(model, d: Dest, t: torch.Tensor, name: str) -> int:
    """A bias: the rows of `{param}_bias` that its weight fills in `param` (counted for `{param}_bias`)."""
    owner = _owner(model, d)
    bias = _param(owner, f"{d.param}_bias", name)
    rows = None if d.part is None else owner.parts[d.param][d.part]
    if d.expert is None and model.kept.place(bias, rows, t):
        return t.numel()
    dst = part_rows(owner, d, bias)
    copy_weight(dst, t, name)
    return dst.numel()


def load_weight_scale(model, d: Dest, t: torch.Tensor, name: str) -> int:
    """A prequantized (compressed-tensors) linear's scales: per channel [N, 1], or per tensor (a scalar)
    broadcast to the rows of that projection."""
    owner = _owner(model, d)
    scales = owner.fp8_scales.get(d.param) if d.layer is not None and model.spec.prequantized else None
    if scales is None:
        raise UnsupportedModelError(f"unexpected weight {name!r}")
    dst = part_rows(owner, d, scales)
    dst.copy_(t.float().reshape(-1, 1).expand_as(dst) if t.numel() == 1 else t.float().reshape(dst.shape))
    return 0


def load_kv_scale(model, d: Dest, t: torch.Tensor, name: str) -> int:
    """self_attn.k_scale / v_scale: the fp8 KV cache scales the checkpoint calibrated (engine/kv_cache.py)."""
    model.checkpoint_kv_scales.setdefault(d.layer, {})[d.suffix[0]] = float(t.float().reshape(-1)[0])
    return 0


def load_input_scale(model, d: Dest, t: torch.Tensor, name: str) -> int:
    """A static per-tensor activation scale (compressed-tensors fp8 with static input quantization). The parts of a
    fused linear share one input, so they take the largest of their scales (as vLLM): no part's activations clip."""
    owner = _owner(model, d)
    q = model.spec.quant
    if d.layer is None or q is None or q.activations != "static" or d.param not in owner.fp8_scales:
        raise UnsupportedModelError(f"unexpected weight {name!r}")
    s = t.float().reshape(-1)[:1].to(owner.fp8_scales[d.param].device)  # [1]
    have = owner.input_scales.get(d.param)
    owner.input_scales[d.param] = s if have is None else torch.maximum(have, s)
    return 0


LOADERS: dict[str, Loader] = {
    "weight": load_weight,
    "bias": load_bias,
    "weight_scale": load_weight_scale,
    "k_scale": load_kv_scale,
    "v_scale": load_kv_scale,
    "input_scale": load_input_scale,
}


def check_complete(model, filled: Counter, table: dict) -> None:
    """Every parameter but the OPTIONAL ones was filled whole: filled[(layer, param)] counts elements written."""
    missing = []
    for i, owner in [(None, model), *enumerate(model.layers)]:
        for attr, p in owner.named_parameters(recurse=False):
            if attr not in OPTIONAL and filled[i, attr] != p.numel():
                sources = "|".join(k for k, v in table.items() if v and v[0] == attr)  # the names that fill it
                where = "" if i is None else f"model.layers.{i}."
                missing.append(f"{where}{sources} ({filled[i, attr]} of {p.numel()} values)")
    if missing:
        raise UnsupportedModelError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")


def load_into(dst: torch.Tensor, scales: torch.Tensor | None, t: torch.Tensor, name: str, dtype) -> None:
    """Checkpoint tensor `t` into parameter rows `dst`: copied, or with `scales` (online fp8) quantized per output
    channel from `dtype` (the model's) into dst's e4m3 and scales' [N, 1] fp32."""
    if scales is None:
        return copy_weight(dst, t, name)
    if dst.shape != t.shape:
        copy_weight(dst, t, name)  # raises with the shapes
    wq, scale = quant_per_channel(t.to(device=dst.device, dtype=dtype))
    dst.copy_(wq)
    scales.copy_(scale)


def copy_weight(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """dst.copy_(src), refusing a shape the config does not give."""
    if dst.shape != src.shape:
        raise UnsupportedModelError(
            f"weight {name}: shape {tuple(src.shape)} does not match config ({tuple(dst.shape)})"
        )
    dst.copy_(src)


def target(model, d: Dest, name: str) -> torch.Tensor:
    """The rows of our parameter that checkpoint tensor `name` fills."""
    owner = _owner(model, d)
    return part_rows(owner, d, _param(owner, d.param, name))


def _owner(model, d: Dest):
    return model if d.layer is None else model.layers[d.layer]


def _param(owner, attr: str, name: str) -> torch.Tensor:
    p = getattr(owner, attr, None)
    if not isinstance(p, torch.Tensor):  # a bias this model has not, a module named in the wrong place
        raise UnsupportedModelError(f"unexpected weight {name!r}")
    return p


def part_rows(owner, d: Dest, x: torch.Tensor) -> torch.Tensor:
    """Of x (the parameter, or its scales): expert d.expert of a stacked one, then rows d.part of a fused one."""
    x = x if d.expert is None else x[d.expert]
    return x if d.part is None else x.narrow(0, *owner.parts[d.param][d.part])
