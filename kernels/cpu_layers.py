"""A Llama-family decoder stack's layers in one C call (kernels/cpu_layers.c): the structures it reads, and the build.

Why: a CPU decode step of SmolLM2 runs about ten kernels a layer, each behind a ctypes call, torch's allocations and
views and our checks: measured on the AMD EPYC Zen 4 VM (perf, the issue workload of bench/throughput.py), about
1.0 s of 7.7 s ran on one core in Python and torch's dispatch while the other waited in OpenMP's barrier. The C loop
calls the same kernels (their builds' own functions, by pointer) in the same order, so its output is the Python
path's bit for bit; engine/layers/native_stack.py decides when it runs and fills these structures."""

from __future__ import annotations

import ctypes
from pathlib import Path

from kernels.cpu_build import NativeKernel

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Linear(ctypes.Structure):
    """linear_t: a weight [n, k] bf16, its packed copy (None until made), an fp32 bias (or None)."""

    _fields_ = [("w", _P), ("packed", _P), ("bias", _P), ("n", _I64), ("k", _I64)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear), ("input_norm", _P),
                ("post_norm", _P), ("k_cache", _P), ("v_cache", _P), ("window", _I64)]  # fmt: skip


class Model(ctypes.Structure):
    _fields_ = [("gemm", _P), ("gemm_kind", _I64), ("gemm_silu", _P), ("norm", _P), ("rope", _P), ("silu", _P),
                ("attn", _P), ("silu_table", _P), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64),
                ("head_dim", _I64), ("inter", _I64), ("blocks", _I64), ("block_size", _I64), ("eps", _F), ("scale", _F),
                ("softcap", _F), ("k_scale", _P), ("v_scale", _P)]  # fmt: skip


class Step(ctypes.Structure):
    _fields_ = [("t", _I64), ("nseq", _I64), ("table_stride", _I64), ("cos", _P), ("sin", _P), ("slots", _P),
                ("tables", _P), ("ctx", _P), ("qsl", _P), ("x", _P), ("qkv", _P), ("q", _P), ("k", _P),
                ("attn", _P), ("gu", _P), ("act", _P)]  # fmt: skip


GEMM_KINDS = {"thin": 0, "avx2": 1}  # the thin GEMM's gemm_any (AVX512-BF16), the AVX2 GEMM's gemm


def address(fn) -> int:
    """A loaded library's function as the pointer the C calls."""
    return ctypes.cast(fn, ctypes.c_void_p).value


class NativeLayers(NativeKernel):
    """The compiled loop (one per process: the key is None)."""

    SOURCE = Path(__file__).with_name("cpu_layers.c")
    WHAT, FALLBACK = "CPU decoder layers", "the layers run from Python"

    def setup(self, lib) -> None:
        lib.run_layers.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(Layer), _I64, ctypes.POINTER(Step), _P, _P,
                                   ctypes.c_int]  # fmt: skip
        lib.run_layers.restype = ctypes.c_int

    @classmethod
    def get(cls, cache_dir: Path, wait: bool = False) -> NativeLayers:
        return super().get(None, cache_dir, wait)

    def run(self, model: Model, layers, step: Step, h: int, res: int, nthreads: int) -> None:
        """Every layer on h [T, hidden] (the embedding rows in, the last layer's output out) and res (the residual
        out); raises what the kernels' own Python wrappers raise."""
        rc = self.lib.run_layers(ctypes.byref(model), layers, len(layers), ctypes.byref(step), h, res, nthreads)
        if rc:
            layer, what = divmod(rc, 16)
            if what == 3:
                raise ValueError(f"CPU attention (layer {layer}): a slot past the cache's rows")
            raise MemoryError(f"CPU decoder layers (layer {layer}): out of memory for a kernel's buffers")
