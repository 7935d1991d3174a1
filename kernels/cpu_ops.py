"""A CPU layer's add + RMSNorm, rotary embedding and SiLU-and-mul in C (kernels/cpu_ops.c), bf16 only, against
add_rms_norm_ref / rms_norm_ref (kernels/rmsnorm.py), rotate_ref (kernels/rotary.py) and silu_and_mul_ref
(kernels/activation.py).

Why: the norm's reference is 9 torch ops, each a dispatch and a pass over memory, twice a layer: at a 2048-token
prefill chunk of SmolLM2 on 2 threads of the Xeon VM, 2.8-8.3 ms against the C pass's 1.1, and at a decode step's
16 rows 71 us against 27. The rotary's is 5 ops for q and 5 for k. Built like the attention kernel
(kernels/cpu_build.py) and used once loaded; until then, for fp32 (whose greedy output must equal HF's token for
token) and for fp16, the references run. The rotary and SiLU-and-mul are bit for bit their references (the latter
looks F.silu up in a table torch computed for every bf16 gate, `silu_table`: a bf16 gate has 65536 values); the norm
is not: the mean's sum runs in another order, so an output can differ by a bf16 step or two
(tests/kernels/test_cpu_ops.py bounds it)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu_build import NativeKernel

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class CpuOps(NativeKernel):
    """The compiled ops (one per process: the key is None)."""

    SOURCE = Path(__file__).with_name("cpu_ops.c")
    WHAT, FALLBACK = "CPU norm and rotary", "the torch references stay"

    def setup(self, lib) -> None:
        lib.add_rms_norm.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, ctypes.c_float, ctypes.c_int]
        lib.rope.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, ctypes.c_int]
        lib.add_rms_norm.restype = lib.rope.restype = None
        if hasattr(lib, "silu_and_mul_lut"):
            lib.silu_and_mul_lut.argtypes = [_P, _I64, _I64, _I64, _P, _P, ctypes.c_int]
            lib.silu_and_mul_lut.restype = None
        elif hasattr(lib, "silu_and_mul"):  # a past revision's, by a polynomial exp (bench/cpu_ops.py --against REV)
            lib.silu_and_mul.argtypes, lib.silu_and_mul.restype = [_P, _I64, _I64, _I64, _P, ctypes.c_int], None

    @classmethod
    def get(cls, cache_dir: Path, wait: bool = False) -> CpuOps:
        return super().get(None, cache_dir, wait)


def library(*tensors: torch.Tensor):
    """The loaded library when every tensor is a bf16 CPU tensor with a contiguous last dim, else None."""
    if (k := CpuOps.loaded()) is None:
        return None
    ok = all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
    return k.lib if ok else None


def add_rms_norm(lib, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(rms_norm(residual + x) * weight, residual + x) for x, residual [..., n] and weight [n], as new tensors;
    residual None: (rms_norm(x) * weight, None)."""
    n = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    res = None if residual is None else torch.empty_like(x)
    lib.add_rms_norm(
        x.data_ptr(), None if residual is None else residual.contiguous().data_ptr(), weight.contiguous().data_ptr(),
        out.data_ptr(), None if res is None else res.data_ptr(), x.numel() // n, n, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out, res


@functools.cache
def silu_table() -> torch.Tensor:
    """F.silu at every bf16 value, indexed by its bits: [65536 + 1] int16 (the C reads 32 bits at an entry: it and
    the next). torch computes it, so the C op's SiLU is torch's bit for bit."""
    bits = torch.arange(65536, dtype=torch.int32)
    x = torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.bfloat16)
    return torch.cat([F.silu(x).view(torch.int16), torch.zeros(1, dtype=torch.int16)])


def silu_and_mul(lib, x: torch.Tensor) -> torch.Tensor | None:
    """silu_and_mul_ref(x) for x [T, 2 * I] (rows may be apart) as a new [T, I]; None when I is not a multiple of 16."""
    if x.dim() != 2 or x.shape[1] % 32:
        return None
    t, inter = x.shape[0], x.shape[1] // 2
    out = x.new_empty(t, inter)
    if hasattr(lib, "silu_and_mul_lut"):
        lib.silu_and_mul_lut(x.data_ptr(), t, inter, x.stride(0), silu_table().data_ptr(), out.data_ptr(),
                             torch.get_num_threads())  # fmt: skip
    else:  # a past revision's (bench/cpu_ops.py --against REV)
        lib.silu_and_mul(x.data_ptr(), t, inter, x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def rope(lib, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor | None:
    """rotate_ref(x, c, s) for x [T, heads, D] (rows and heads may be strided) and c, s [T, 1, D] (rotary_rows), as a
    new contiguous tensor; None when the shapes do not suit the kernel (D / 2 not a multiple of 16)."""
    t, heads, d = x.shape
    if d % 32 or x.stride(2) != 1 or c.stride(-1) != 1 or c.stride() != s.stride() or c.shape[0] != t:
        return None
    out = x.new_empty(t, heads, d)
    lib.rope(x.data_ptr(), t, heads, x.stride(0), x.stride(1), c.data_ptr(), s.data_ptr(), c.stride(0), d,
             out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out
