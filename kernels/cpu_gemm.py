"""A bf16 linear for few rows on CPUs with AVX512-BF16, in C (kernels/cpu_gemm.c), against thin_linear_ref.

Why: a decode step's linears have a row per sequence, and at 1-32 rows they mostly read the weights. oneDNN's packed
GEMM reads them at 5-9 GB/s there on 2 cores of a Xeon VM whose memory gives 10-16; these AMX tiles, fed one weight
tile per K step and up to four 16-row A tiles, at 9-16 (`python -m bench.cpu_gemm`, docs/benchmarks.md). From about
64 rows on the GEMM is compute-bound, and oneDNN's blocking wins: dense() hands this kernel only rows <= MAX_ROWS.

Where the CPU has AVX512-BF16 but no AMX (AMD Zen 4 and later), the same packed layout feeds vdpbf16ps: a tile of
6 rows x 64 columns, each of the group's panel read from memory once and from L2 for the later row tiles, while
the next group's panel is prefetched. oneDNN pads these row counts to its buckets and reblocks per call; this
kernel takes every row count to MAX_ROWS = 64: 1.1-2.4x oneDNN's packed GEMM at 1-32 rows, even at 64, behind
from 128 (`python -m bench.cpu_gemm`, docs/benchmarks.md "CPU GEMM (AVX512-BF16)").

The weight is packed once into AMX's B-tile layout (`ThinWeight`, an IdleWork piece a layer, as oneDNN's copy),
beside the parameter, which the engine still reads. Built like the attention kernel (kernels/cpu_build.py), and only
where /proc/cpuinfo lists avx512_bf16; elsewhere the linears stay oneDNN's.

`Avx2Gemm` (kernels/cpu_gemm_avx2.c) is the other CPU GEMM here: every bf16 linear, at every row count, on CPUs
where oneDNN has no bf16 GEMM at all (AVX2 alone), in one summation order."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu_build import NativeKernel, cpu_flags

AMX_MAX_ROWS, DOT_MAX_ROWS = 32, 64  # measured crossings with oneDNN's packed GEMM (bench/cpu_gemm.py)
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def thin_linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ w[N, K]^T + bias, summed in fp32, in x's dtype."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)


def has_amx() -> bool:
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags()


MAX_ROWS = AMX_MAX_ROWS if has_amx() else DOT_MAX_ROWS  # dense() hands this kernel rows up to here


def has_thin() -> bool:
    """Whether the thin GEMM builds here: AMX's tiles, or else AVX512-BF16's dot products (one packed layout)."""
    return "avx512_bf16" in cpu_flags()


def has_avx2() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


def fits(w: torch.Tensor) -> bool:
    """Whether a weight has the kernel's shape: bf16 [N, K] with N a multiple of 16 and K of 32 (whole tiles)."""
    return w.dim() == 2 and w.dtype == torch.bfloat16 and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0


class ThinGemm(NativeKernel):
    """The compiled kernel (one per process: the key is None)."""

    SOURCE = Path(__file__).with_name("cpu_gemm.c")
    WHAT, FALLBACK = "CPU thin GEMM (AVX512-BF16)", "the linears stay oneDNN's"

    def setup(self, lib) -> None:
        lib.pack.argtypes, lib.pack.restype = [_P, _I64, _I64, _P], None
        lib.gemm.argtypes, lib.gemm.restype = [_P, _I64, _I64, _P, _I64, _P, _P, ctypes.c_int], ctypes.c_int
        if lib.amx_init() != 0:
            raise RuntimeError("the kernel refused AMX's tile data to this process (arch_prctl)")

    @classmethod
    def get(cls, cache_dir: Path, wait: bool = False) -> ThinGemm | None:
        """The kernel where this CPU has AVX512-BF16 (None elsewhere), loaded now when it is built, else built by a
        thread."""
        return super().get(None, cache_dir, wait) if has_thin() else None

    @staticmethod
    def fits(w: torch.Tensor) -> bool:
        return fits(w)

    def pack(self, w: torch.Tensor) -> ThinWeight:
        w = w.detach().contiguous()
        packed = torch.empty(w.numel(), dtype=torch.bfloat16)
        self.lib.pack(w.data_ptr(), w.shape[0], w.shape[1], packed.data_ptr())
        return ThinWeight(packed, w.shape[0], w.shape[1], self.lib)


class Avx2Gemm(NativeKernel):
    """The bf16 linear at every row count on CPUs with AVX2 and FMA where oneDNN has no bf16 GEMM
    (kernels/cpu_gemm_avx2.c): each output one FMA chain in K's order whatever the row count, on the weight as the
    model holds it or on its packed copy (`pack`: panels of 16 columns, the same sums). The engine starts it only on
    such a CPU (engine/cpu_native.py)."""

    SOURCE = Path(__file__).with_name("cpu_gemm_avx2.c")
    WHAT, FALLBACK = "CPU GEMM (AVX2)", "bf16 linears widen to MKL's fp32 GEMM per call"
    NR = 16  # columns a packed panel

    def setup(self, lib) -> None:
        lib.gemm.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I64, _P, _P, ctypes.c_int]
        lib.gemm.restype = ctypes.c_int
        lib.pack.argtypes, lib.pack.restype = [_P, _I64, _I64, _P, ctypes.c_int], None

    @classmethod
    def get(cls, cache_dir: Path, wait: bool = False) -> Avx2Gemm | None:
        return super().get(None, cache_dir, wait) if has_avx2() else None

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """w [N, K] bf16 -> its panels, [ceil(N / 16), K, 16] bf16 (the kernel's order within each)."""
        w = w.detach().contiguous()
        n, k = w.shape
        packed = torch.empty(-(-n // self.NR), k, self.NR, dtype=torch.bfloat16)
        self.lib.pack(w.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
        return packed

    def linear(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, K] bf16 @ w [N, K] bf16 ^T (+ bias [N]) -> [M, N] bf16; `packed`: pack(w), read instead of w."""
        if x.shape[1] != w.shape[1] or (bias is not None and bias.shape != w.shape[:1]):  # the C reads what it's told
            raise ValueError(f"linear: x {tuple(x.shape)}, weight {tuple(w.shape)}, bias "
                             f"{None if bias is None else tuple(bias.shape)} do not fit")  # fmt: skip
        if packed is not None and (packed.shape != (-(-w.shape[0] // self.NR), w.shape[1], self.NR)
                                   or packed.dtype != torch.bfloat16 or not packed.is_contiguous()):  # fmt: skip
            raise ValueError(f"linear: packed {packed.dtype} {tuple(packed.shape)} is not weight {tuple(w.shape)}'s")
        if x.stride(-1) != 1:
            x = x.contiguous()
        w = w if packed is not None else w.contiguous()
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
        b = None if bias is None else bias.float().contiguous()
        w_ptr, p_ptr = (None, packed.data_ptr()) if packed is not None else (w.data_ptr(), None)
        failed = self.lib.gemm(
            x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), w_ptr, p_ptr, w.shape[0], y.data_ptr(),
            None if b is None else b.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("CPU GEMM (AVX2): out of memory for its temporaries (x in fp32, a weight panel)")
        return y


class ThinWeight:
    """A weight [N, K] in the thin GEMM's tile layout (AMX's B tiles); called as the linear."""

    __slots__ = ("packed", "n", "k", "lib")

    def __init__(self, packed: torch.Tensor, n: int, k: int, lib):
        self.packed, self.n, self.k, self.lib = packed, n, k, lib

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] bf16 -> [M, N] bf16."""
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.n, dtype=torch.bfloat16)
        b = None if bias is None else bias.float().contiguous()
        failed = self.lib.gemm(
            x.data_ptr(), x.shape[0], self.k, self.packed.data_ptr(), self.n, y.data_ptr(),
            None if b is None else b.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("CPU thin GEMM: out of memory for its temporaries")
        return y
