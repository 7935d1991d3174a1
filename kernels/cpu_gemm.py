"""The bf16 linear on CPUs with AVX512-BF16, in C (kernels/cpu_gemm.c), against thin_linear_ref: every bf16 linear
that fits, at every row count (`ThinGemm.linear`), in one summation order, on the weight itself (each panel packed as
it is reached) until its copy is packed, so a token's sums never depend on its step or on whether packing has
finished; and that copy is the only one (no oneDNN copy).

Why: a decode step's linears have a row per sequence, and at 1-32 rows they mostly read the weights, which oneDNN's
packed GEMM does at about half the memory's rate on 2 cores; and a prefill chunk's rows in oneDNN's order would
give a token other sums than its decode does (a whole response and its stream then differ where two tokens tie).

With AMX (Intel Sapphire Rapids and later): per thread, groups of 2 column blocks over L2-sized chunks of rows, 32
rows x 32 columns in four tiles at a time, the next group's panel prefetched past 32 rows (at fewer the L2's own
prefetcher streams it), each step's sums rounded and stored while the next step's tiles run. On 2 cores of a Xeon
with AMX, against oneDNN's packed GEMM: 0.9-1.8x by shape at 1-64 rows, 0.97-2.2x at 128-1024, 0.87-1.14x at a
2048-token chunk (`python -m bench.cpu_gemm`, docs/benchmarks.md "CPU GEMM (AMX)").

Without AMX (AMD Zen 4 and later) the same packed layout feeds vdpbf16ps: a tile of 6 rows x 64 columns, each of
the group's panel read from memory once and from L2 for the later row tiles, while the next group's panel is
prefetched: at 1-32 rows 1.1-2.4x oneDNN's packed GEMM, even with it from 64 rows to a 2048-token prefill chunk
(docs/benchmarks.md "CPU GEMM (AVX512-BF16)").

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

# dense() hands the kernel every row count up to MAX_ROWS (--ab thin-gemm sets it to 0)
MAX_ROWS = 1 << 40
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def thin_linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ w[N, K]^T + bias, summed in fp32, in x's dtype."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)


def has_amx() -> bool:
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags()


def has_thin() -> bool:
    """Whether the thin GEMM builds here: AMX's tiles, or else AVX512-BF16's dot products (one packed layout)."""
    return "avx512_bf16" in cpu_flags()


def has_avx2() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


def fits(w: torch.Tensor) -> bool:
    """Whether a weight has the kernel's shape: bf16 [N, K] with N a multiple of 16 and K of 32 (whole tiles), neither
    0 (the kernel divides by K's tiles)."""
    return (w.dim() == 2 and w.dtype == torch.bfloat16 and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0
            and w.shape[0] > 0 and w.shape[1] > 0)  # fmt: skip


class ThinGemm(NativeKernel):
    """The compiled kernel (one per process: the key is None)."""

    SOURCE = Path(__file__).with_name("cpu_gemm.c")
    WHAT, FALLBACK = "CPU thin GEMM (AVX512-BF16)", "the linears stay oneDNN's"

    def setup(self, lib) -> None:
        lib.pack.argtypes, lib.pack.restype = [_P, _I64, _I64, _P], None
        lib.gemm.argtypes, lib.gemm.restype = [_P, _I64, _I64, _P, _I64, _P, _P, ctypes.c_int], ctypes.c_int
        if hasattr(lib, "gemm_any"):  # a past revision's AMX build lacks it (bench --against)
            lib.gemm_any.argtypes = [_P, _I64, _I64, _P, _P, _I64, _P, _P, ctypes.c_int]
            lib.gemm_any.restype = ctypes.c_int
        if hasattr(lib, "gemm_silu"):
            lib.gemm_silu.argtypes = [_P, _I64, _I64, _P, _P, _I64, _P, _P, _P, ctypes.c_int]
            lib.gemm_silu.restype = ctypes.c_int
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

    @property
    def every_row(self) -> bool:
        """Whether it runs every row count (`linear`; a past revision's AMX build ran a decode's few rows alone):
        dense() gives it every bf16 linear that fits, on the weight itself until its copy is packed, so a token's
        sums never depend on its step."""
        return self.lib is not None and hasattr(self.lib, "gemm_any")

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias=None, packed: ThinWeight | None = None,
               silu: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """x [M, K] bf16 @ w [N, K] bf16 ^T (+ bias [N]) -> [M, N] bf16, at any M: from `packed` (pack(w)) when
        given, else from w, each panel packed as it is reached (the same sums). With `silu` (kernels/cpu_ops.py
        silu_table()), w is [gate; up] and the result [M, N / 2] silu_and_mul's of that product, bit for bit, in one
        pass (gemm_silu)."""
        if not self.every_row:
            raise RuntimeError("linear: this revision's AMX build reads its packed copy only (ThinWeight)")
        if (x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_cpu or x.shape[1] != w.shape[1] or not fits(w)
                or not w.is_cpu or (bias is not None and bias.shape != w.shape[:1])
                or (silu is not None and (w.shape[0] % 32 or silu.shape != (65537,) or silu.dtype != torch.int16))
        ):  # fmt: skip
            raise ValueError(f"linear: x {tuple(x.shape)}, weight {tuple(w.shape)}, bias "
                             f"{None if bias is None else tuple(bias.shape)} do not fit")  # fmt: skip
        if packed is not None and (packed.n, packed.k) != tuple(w.shape):
            raise ValueError(f"linear: packed [{packed.n}, {packed.k}] is not weight {tuple(w.shape)}'s")
        x = x.contiguous()
        w = w if packed is not None else w.contiguous()
        y = torch.empty(x.shape[0], w.shape[0] // (1 if silu is None else 2), dtype=torch.bfloat16)
        b = None if bias is None else bias.float().contiguous()
        wp, raw = (packed.packed.data_ptr(), None) if packed is not None else (None, w.data_ptr())
        args = (x.data_ptr(), x.shape[0], x.shape[1], wp, raw, w.shape[0], y.data_ptr(),
                None if b is None else b.data_ptr())  # fmt: skip
        threads = torch.get_num_threads()
        failed = (
            self.lib.gemm_any(*args, threads) if silu is None else self.lib.gemm_silu(*args, silu.data_ptr(), threads)
        )
        if failed:
            raise MemoryError("CPU thin GEMM: out of memory for its panel buffers")
        return y

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
        if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_cpu or x.shape[1] != self.k or (
                bias is not None and bias.shape != (self.n,)):  # fmt: skip
            raise ValueError(f"thin weight [{self.n}, {self.k}]: x {tuple(x.shape)} {x.dtype}, bias "
                             f"{None if bias is None else tuple(bias.shape)} do not fit")  # fmt: skip
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
