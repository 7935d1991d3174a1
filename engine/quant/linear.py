"""A decoder layer's linears in a quantized checkpoint's own layout, where the Triton kernels run them (packed: the
GPU, or the interpreter when tests force the Triton backend). On the torch backend the checkpoint is dequantized at
load instead (engine/quant/convert.py) and the layer is an ordinary 16-bit one.

- IntLinears (AWQ, GPTQ, compressed-tensors W4A16 / W8A16): each linear's parameter is the packed int32
  [N, ceil(K / P)], its rows fused as the 16-bit ones are (q, k, v; gate, up); scales [N, G], zeros [N, G]
  (asymmetric) and the act-order permutation [K] are kept here, filled by the loaders below.
- The loaders: `iq_weight` / `iq_scales` / `iq_zeros` fill rows of a part, `iq_perm` sets the permutation (the
  parts of a fused linear share their input, so their permutations must agree; GPTQ's act-order is computed from
  that shared input)."""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import UnsupportedModelError
from engine.quant.scheme import QuantScheme
from kernels.fp8_block import fp8_block_linear
from kernels.int_gemm import int_linear


class IntLinears:
    def __init__(self, layer: nn.Module, scheme: QuantScheme, shapes: dict[str, tuple[int, int]], dtype, device):
        """shapes: linear name -> (N, K) of its 16-bit weight; each becomes the packed parameter on `layer`."""
        self.bits, self.per = scheme.bits, 32 // scheme.bits
        self.k = {name: k for name, (_, k) in shapes.items()}
        self.group = {name: scheme.group_size or k for name, (_, k) in shapes.items()}
        self.scales, self.zeros, self.perm = {}, {}, {}
        for name, (n, k) in shapes.items():
            g = -(-k // self.group[name])
            setattr(layer, name, nn.Parameter(torch.empty(n, -(-k // self.per), dtype=torch.int32, device=device),
                                              False))  # fmt: skip
            self.scales[name] = torch.empty(n, g, dtype=scheme.scale_dtype(dtype), device=device)
            self.zeros[name] = None if scheme.symmetric else torch.empty(n, g, dtype=torch.uint8, device=device)
            self.perm[name] = None

    def linear(self, layer: nn.Module, name: str, x: torch.Tensor, bias=None) -> torch.Tensor:
        return int_linear(x, getattr(layer, name), self.scales[name], self.zeros[name], self.perm[name], self.bits,
                          self.group[name], bias)  # fmt: skip

    def nbytes(self) -> int:
        tensors = [*self.scales.values(), *self.zeros.values(), *self.perm.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Fp8BlockLinears:
    """Block-scaled fp8 (HF's fine-grained fp8): the layer's linear parameters are e4m3 [N, K] (filled by the usual
    weight loader, rows fused as always); their scales [ceil(N / bn), ceil(K / bk)] are kept here. A fused
    linear's parts must start on a block row (q, k and v sizes multiples of bn), or the start is refused."""

    def __init__(self, layer: nn.Module, scheme: QuantScheme, shapes: dict[str, tuple[int, int]], device):
        self.block = scheme.block
        bn, bk = self.block
        self.scales = {name: torch.ones(-(-n // bn), -(-k // bk), device=device) for name, (n, k) in shapes.items()}
        for name, (n, k) in shapes.items():
            setattr(layer, name, nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device), False))

    def linear(self, layer: nn.Module, name: str, x: torch.Tensor, bias=None) -> torch.Tensor:
        return fp8_block_linear(x, getattr(layer, name), self.scales[name], self.block, bias)

    def nbytes(self) -> int:
        return sum(t.numel() * 4 for t in self.scales.values())


def load_block_scales(model, d, t: torch.Tensor, name: str) -> int:
    owner = model.layers[d.layer]
    q = getattr(owner, "quant_linears", None)
    if not isinstance(q, Fp8BlockLinears):
        raise UnsupportedModelError(f"unexpected weight {name!r}: this layer is not block-quantized fp8")
    dst = q.scales[d.param]
    if d.part is not None:
        bn = q.block[0]
        start, rows = owner.parts[d.param][d.part]
        if start % bn:
            raise UnsupportedModelError(
                f"{name}: its rows start at {start}, inside a {bn}-row scale block of the fused {d.param}; "
                f"block-wise fp8 needs part sizes that are multiples of {bn}"
            )
        dst = dst.narrow(0, start // bn, -(-rows // bn))
    if dst.shape != t.shape:
        raise UnsupportedModelError(f"{name}: shape {tuple(t.shape)} does not match config ({tuple(dst.shape)})")
    dst.copy_(t)
    return 0


def _rows(owner, d, x: torch.Tensor) -> torch.Tensor:
    return x if d.part is None else x.narrow(0, *owner.parts[d.param][d.part])


def _int(owner, name: str) -> IntLinears:
    q = getattr(owner, "quant_linears", None)
    if not isinstance(q, IntLinears):
        raise UnsupportedModelError(f"unexpected weight {name!r}: this layer is not int-quantized")
    return q


def load_iq_weight(model, d, t: torch.Tensor, name: str) -> int:
    owner = model.layers[d.layer]
    _int(owner, name)
    dst = _rows(owner, d, getattr(owner, d.param))
    if dst.shape != t.shape:
        raise UnsupportedModelError(f"{name}: packed shape {tuple(t.shape)} does not match config ({tuple(dst.shape)})")
    dst.copy_(t)
    return t.numel()


def load_iq_scales(model, d, t: torch.Tensor, name: str) -> int:
    owner = model.layers[d.layer]
    table = _int(owner, name).scales if d.suffix == "iq_scales" else _int(owner, name).zeros
    dst = table[d.param]
    if dst is None:
        raise UnsupportedModelError(f"{name}: zero points for a symmetric scheme")
    dst = _rows(owner, d, dst)
    if dst.shape != t.shape:
        raise UnsupportedModelError(f"{name}: shape {tuple(t.shape)} does not match config ({tuple(dst.shape)})")
    dst.copy_(t)
    return 0


def load_iq_perm(model, d, t: torch.Tensor, name: str) -> int:
    q = _int(model.layers[d.layer], name)
    have = q.perm[d.param]
    t = t.to(device=q.scales[d.param].device)
    if have is not None and not torch.equal(have, t):
        raise UnsupportedModelError(f"{name}: its act-order permutation differs from its fused sibling's")
    q.perm[d.param] = t
    return 0


LOADERS = {"iq_weight": load_iq_weight, "iq_scales": load_iq_scales, "iq_zeros": load_iq_scales,
           "iq_perm": load_iq_perm, "weight_scale_inv": load_block_scales}  # fmt: skip
