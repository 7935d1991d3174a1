"""A quantized checkpoint's tensors -> the engine's layouts, as the weights stream in (before tensor-parallel
sharding, so that shards are cut from one layout).

Each quantized module's tensors (a format's qweight, qzeros, scales, g_idx ...) are held until the module is whole,
then converted once:
- packed (GPU): kernels/int_gemm.py's layout, as `{module}.iq_weight` int32 [N, K / P], `.iq_scales` [N, G],
  `.iq_zeros` uint8 [N, G] (asymmetric only) and `.iq_perm` int64 [K] (act-order only);
- dense (CPU): the dequantized weight as `{module}.weight` in the model dtype, in the original column order, so the
  model is an ordinary 16-bit one (the CPU GEMM on 16-bit weights is the fast path there; docs/decisions.md).
fp8 block-wise checkpoints pass through packed (their `weight` and `weight_scale_inv` are the kernel's layout) and
are dequantized when dense.

The formats, as their writers lay them out:
- AutoAWQ GEMM: qweight int32 [K, N / 8], 8 columns a word in the order 0 2 4 6 1 3 5 7; qzeros [K / G, N / 8] the
  same way; scales [K / G, N]. w = (q - z) * s.
- GPTQ (AutoGPTQ, GPTQModel): qweight int32 [K / P, N] packed along K in natural order; qzeros [K / G, N / P] packed
  along N, stored less one in the original "gptq" format; scales [K / G, N]; g_idx [K] each input channel's group
  (act-order: groups are chunks of G channels in another order).
- compressed-tensors pack-quantized: weight_packed int32 [N, K / P] along K, natural order, values offset by
  2^(bits-1); weight_scale [N, G]; weight_zero_point packed along N the same way (asymmetric); weight_g_idx
  (act-order "group"); weight_shape [2]."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.errors import UnsupportedModelError
from engine.quant.scheme import QuantScheme
from kernels.int_gemm import dequantize, pack, unpack

FP8 = torch.float8_e4m3fn
# a decoder layer's linears, as checkpoints name them (a mixed checkpoint keeps some of them 16-bit)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its eight
# per source: (the suffixes a module needs, the ones it may have)
SUFFIXES = {
    "awq": ({"qweight", "qzeros", "scales"}, set()),
    "gptq": ({"qweight", "qzeros", "scales"}, {"g_idx"}),
    "compressed-tensors": ({"weight_packed", "weight_scale", "weight_shape"}, {"weight_zero_point", "weight_g_idx"}),
}


def canonical(scheme: QuantScheme, got: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor | None]:
    """One module's tensors in the int layout: qweight [N, K/P], scales [N, G], zeros [N, G] | None, perm | None,
    and k (the input size)."""
    bits = scheme.bits
    if scheme.source == "awq":
        q = unpack(got["qweight"], 4, order=AWQ_ORDER)  # [K, N]
        z = unpack(got["qzeros"], 4, order=AWQ_ORDER)  # [G, N]
        q, z, s, g_idx = q.t(), z.t(), got["scales"].t(), None
    elif scheme.source == "gptq":
        q = unpack(got["qweight"].t().contiguous(), bits)  # [N, K] (packed along K: the transpose is ours)
        z = unpack(got["qzeros"], bits).t() + (1 if scheme.zeros_minus_one else 0)  # [N, G]
        s, g_idx = got["scales"].t(), got.get("g_idx")
        z = None if scheme.symmetric else z
    else:  # compressed-tensors
        k = int(got["weight_shape"][1])
        q = unpack(got["weight_packed"], bits)[:, :k]  # [N, K], already offset to unsigned
        s, g_idx = got["weight_scale"], got.get("weight_g_idx")
        zp = got.get("weight_zero_point")  # packed along N with the same offset: unsigned = zero + 2^(bits-1)
        z = None if zp is None else unpack(zp.t().contiguous(), bits).t()[: q.shape[0]]
    k = q.shape[1]
    group = k if scheme.group_size is None else scheme.group_size
    if s.shape[1] != -(-k // group):
        raise UnsupportedModelError(f"{name}: {s.shape[1]} scale groups for {k} inputs in groups of {group}")
    perm = _perm(g_idx, k, group, name)
    if perm is not None:
        q = q[:, perm]
    return {"qweight": pack(q, bits), "scales": s.contiguous(), "zeros": None if z is None else z.to(torch.uint8),
            "perm": perm, "k": k, "group": group}  # fmt: skip


def _perm(g_idx: torch.Tensor | None, k: int, group: int, name: str) -> torch.Tensor | None:
    """Act-order: the column order that makes each group's channels contiguous; None when they already are."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    plain = torch.arange(k) // group
    if torch.equal(g_idx, plain):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], plain):
        raise UnsupportedModelError(f"{name}: g_idx does not give every group {group} channels")
    return perm


class Converter:
    """(name, tensor) stream in, the engine's tensors out; `dense`: dequantized 16-bit weights (CPU)."""

    def __init__(self, scheme: QuantScheme, dtype: torch.dtype, dense: bool):
        self.scheme, self.dtype, self.dense = scheme, dtype, dense

    def __call__(self, stream: Iterator) -> Iterator:
        if self.scheme.kind == "fp8":
            yield from (self._fp8_block(stream) if self.scheme.strategy == "block" else stream)
            return
        need, may = SUFFIXES[self.scheme.source]
        pending: dict[str, dict] = {}
        converted = 0
        for name, t in stream:
            module, _, suffix = name.rpartition(".")
            if suffix not in need | may:
                if not self.dense and suffix == "weight" and module.rsplit(".", 1)[-1] in LINEARS:
                    raise UnsupportedModelError(
                        f"{module} is 16-bit in this {self.scheme.source} checkpoint (modules_to_not_convert or "
                        "ignore) while the other linears are quantized: a mixed layout runs only where the weights "
                        "are dequantized at load (KERNEL_BACKEND=torch), not on the Triton path"
                    )
                yield name, t
                continue
            got = pending.setdefault(module, {})
            got[suffix] = t
            if got.keys() >= need | (may & _expected(self.scheme)):
                converted += 1
                yield from self._emit(module, pending.pop(module))
        for module, got in pending.items():
            if missing := need - got.keys():
                raise UnsupportedModelError(f"{module}: the checkpoint lacks {sorted(missing)}")
            converted += 1
            yield from self._emit(module, got)
        if not converted:
            raise UnsupportedModelError(
                f"quantization_config says {self.scheme.source}, but no tensor of the checkpoint is in that format "
                f"(expected {sorted(need)} per linear)"
            )

    def _emit(self, module: str, got: dict) -> Iterator:
        c = canonical(self.scheme, got, module)
        if self.dense:
            w = dequantize(c["qweight"], c["scales"], c["zeros"], self.scheme.bits, c["group"], c["k"], self.dtype)
            if c["perm"] is not None:
                w = w[:, torch.argsort(c["perm"])]  # back to the original column order
            yield f"{module}.weight", w
            return
        yield f"{module}.iq_weight", c["qweight"]
        yield f"{module}.iq_scales", c["scales"].to(self.scheme.scale_dtype(self.dtype))
        for key in ("zeros", "perm"):
            if c[key] is not None:
                yield f"{module}.iq_{key}", c[key]

    def _fp8_block(self, stream: Iterator) -> Iterator:
        """Block-scaled fp8 weights dequantized (weight * its block's scale_inv) in the model dtype: all of them
        when dense (CPU); else only the experts' and shared experts' (requantized per channel by the MoE layer)."""
        held: dict[str, dict] = {}
        for name, t in stream:
            module, _, suffix = name.rpartition(".")
            keep = not self.dense and ".experts." not in module and ".shared_expert." not in module
            if keep or suffix not in ("weight", "weight_scale_inv") or (suffix == "weight" and t.dtype != FP8):
                yield name, t
                continue
            got = held.setdefault(module, {})
            got[suffix] = t
            if len(got) == 2:
                got = held.pop(module)
                yield f"{module}.weight", block_dequantize(got["weight"], got["weight_scale_inv"], self.scheme.block,
                                                          self.dtype)  # fmt: skip
        if held:
            raise UnsupportedModelError(f"fp8 block weights without their scales (or scales alone): {sorted(held)}")


def _expected(scheme: QuantScheme) -> set[str]:
    """The optional tensors this scheme's modules carry (a module is emitted as soon as it has them)."""
    if scheme.source == "gptq":
        return {"g_idx"}
    return ({"weight_zero_point"} if not scheme.symmetric else set()) | ({"weight_g_idx"} if scheme.desc_act else set())


def block_dequantize(wq: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype) -> torch.Tensor:
    """fp8 [..., N, K] with one scale per block [..., ceil(N/bn), ceil(K/bk)] -> dtype [..., N, K]."""
    n, k = wq.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[..., :k]
    return (wq.float() * s).to(dtype)
