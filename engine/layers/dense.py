"""The 16-bit dense linear of every model: F.linear, with the row count rounded up to a bucket on CPU.

oneDNN (torch's CPU bf16 GEMM) keeps what it builds for each distinct problem shape, and that memory is not given
back: about 150 KB per row count seen, per weight shape, even with its primitive cache off
(ONEDNN_PRIMITIVE_CACHE_CAPACITY=0). A step's row count is its token count, which takes every value from 1 to
MAX_NUM_BATCHED_TOKENS over a worker's life, so a serving worker's memory grew for hours (bench/soak.py, the memory
breakdown: anonymous memory outside the heap's free space). Rounding rows up to a bucket bounds the shapes: at most
16 + 15 + 1 per 64 rows past 256.

A bf16 weight packed once into oneDNN's own layout (`pack`: after ready, as IdleWork pieces) runs its GEMM 1.3-2x
faster at up to 64 rows than the plain weight F.linear hands oneDNN on every call, with the same result bit for bit
(tests/test_dense_pack.py; 576 x 3072 at 64 rows: 0.64 ms -> 0.46 ms on 2 threads of a Xeon with AMX). The packed
copy is memory of its own, beside the parameter (which the rest of the engine still reads).

Where the CPU has AVX512-BF16 (AMX on Intel Sapphire Rapids and later, vdpbf16ps on AMD Zen 4 and later), every bf16
linear whose shape fits runs the thin GEMM (kernels/cpu_gemm.py) at every row count, in one summation order: on the
weight itself, each panel packed as it goes, until IdleWork has packed its copy (the only one: oneDNN's is not made),
then on that copy. The engine waits for the kernel at start, so a server's first requests get the sums its later ones
get. oneDNN's packed copy is for CPUs with its bf16 GEMM but no AVX512-BF16 (Skylake-SP to Ice Lake).

Where oneDNN has no bf16 GEMM for the CPU (AVX2 alone), a bf16 linear runs our AVX2 GEMM at every row count, in one
summation order (kernels/cpu_gemm_avx2.c): a row's result does not depend on the rows beside it. It reads the weight's
packed copy (panels of 16 columns, made by `pack` as the oneDNN copies are) once there is one, and packs each panel as
it goes before: the same sums either way, 1.1-2x faster packed. Without that kernel (no C compiler), MKL's fp32 GEMM
on the weight widened per call (docs/decisions.md, "bf16 linears on CPUs without oneDNN's bf16 GEMM")."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from engine.host_memory import memory_room
from kernels import cpu_gemm, cpu_ops

log = logging.getLogger("engine")

EXACT = 16  # row counts up to this stay as they are (a decode batch; padding would multiply its small GEMMs)


def bucket(rows: int) -> int:
    """The row count a CPU GEMM runs at: exact up to 16, then a multiple of 16 up to 256, then of 64."""
    if rows <= EXACT:
        return rows
    step = 16 if rows <= 256 else 64
    return -(-rows // step) * step


def dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x [T, in] -> [T, out]; a 16-bit one on CPU computed over bucket(T) rows (zeros past T)
    and cut. fp32 goes to MKL's sgemm, which keeps far less per shape (+13 MB over 2,048 shapes, against +280 MB for
    bf16, measured as described in engine/layers/dense.py's docstring), and keeps its exact shapes (the fp32 parity
    tests)."""
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or x.dtype == torch.float32:
        return F.linear(x, w, bias)
    if x.dtype == torch.bfloat16 == w.dtype:
        # ours at every row count, in one order, packed or not (the engine waits for the kernel at start)
        if (gemm := our_gemm(w, rows)) is not None:
            kind, kernel = gemm
            return kernel.linear(x, w, bias, getattr(w, COPIES[kind], None))
        # no oneDNN bf16 GEMM (torch's is 5-9x slower here) and no kernel of ours (no compiler): MKL's fp32 GEMM on
        # the weight widened per call, which pays from a few rows
        if not onednn_bf16() and rows > EXACT:
            return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)
    linear = F.linear
    if (packed := getattr(w, PACKED, None)) is not None and x.dtype == w.dtype:
        w, linear = packed, _packed_linear
    if (padded := bucket(rows)) == rows:
        return linear(x, w, bias)
    xp = x.new_empty(padded, x.shape[1])
    xp[:rows] = x
    xp[rows:] = 0
    return linear(xp, w, bias)[:rows]


FUSED_SILU = True  # bench/ab.py's --ab fused-silu switches it (off: dense() and then silu_and_mul, the same bits)


def dense_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """silu_and_mul(dense(x, w)) for w [gate; up] with no bias, in one call where dense() would run the thin GEMM on w
    (its epilogue takes the SiLU-and-mul: the same bits, kernels/cpu_gemm.py `linear(..., silu=)`); None elsewhere,
    where the caller makes the two calls."""
    if x.device.type != "cpu" or x.dim() != 2 or not x.dtype == w.dtype == torch.bfloat16 or w.shape[0] % 32:
        return None
    if (thin := silu_kernel(our_gemm(w, x.shape[0]))) is None:
        return None
    return thin.linear(x, w, None, getattr(w, THIN, None), silu=cpu_ops.silu_table())


def silu_kernel(gemm):
    """The kernel of our_gemm's (kind, kernel) that takes gate_up's SiLU-and-mul in its epilogue (the thin GEMM's
    gemm_silu; a past revision's build lacks it), or None: the Python loop's and the native stack's one answer."""
    ok = FUSED_SILU and gemm is not None and gemm[0] == "thin" and hasattr(gemm[1].lib, "gemm_silu")
    return gemm[1] if ok else None


PACKED = "onednn_packed"  # the attribute of a weight parameter that holds its packed copy
THIN = "thin_packed"  # or its copy in the thin GEMM's tiles (kernels/cpu_gemm.py)
AVX2_PACKED = "avx2_packed"  # or, where oneDNN has no bf16 GEMM, its copy in the AVX2 GEMM's panels
COPIES = {"thin": THIN, "avx2": AVX2_PACKED}  # our_gemm's kind -> the attribute holding a weight's copy for it
# Where oneDNN has no bf16 GEMM for this CPU (AVX2 alone: AMD EPYC before Zen 4, Intel before Skylake-SP), torch's bf16
# GEMM falls back to a path that ran at 19-20 GFLOP/s on 2 cores of an AVX2 EPYC at every row count from 16 to 2048,
# against MKL's fp32 GEMM at 96-174 (576 x 1536): every bf16 linear runs our AVX2 GEMM instead.
AVX2 = True  # bench/ab.py's --ab avx2-gemm switches it (off: MKL's fp32 GEMM, widened per call)


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN can pack (and run fast) a bf16 linear on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and says so when asked to pack without them."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
        return True
    except (RuntimeError, AttributeError):  # this CPU, or a torch built without oneDNN
        return False


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _thin():
    """The thin GEMM where it runs every bf16 linear (AVX512-BF16, loaded), else None."""
    thin = cpu_gemm.ThinGemm.loaded()
    return thin if thin is not None and thin.every_row else None


def _avx2():
    """The AVX2 GEMM where it runs the bf16 linears (no oneDNN bf16 GEMM, the kernel loaded), else None."""
    return cpu_gemm.Avx2Gemm.loaded() if AVX2 and not onednn_bf16() else None


def our_gemm(w: torch.Tensor, rows: int):
    """(kind, kernel) of the GEMM of ours that dense() runs bf16 weight w on at `rows` rows: the thin GEMM ("thin")
    or the AVX2 GEMM ("avx2"); None where oneDNN's (or MKL's fp32) runs it. Its `linear` takes the
    weight's packed copy, the attribute COPIES[kind] (engine/layers/native_stack.py drives the same kernels)."""
    if (thin := _thin()) is not None and cpu_gemm.fits(w) and rows <= cpu_gemm.MAX_ROWS:
        return "thin", thin
    return None if (avx2 := _avx2()) is None else ("avx2", avx2)


def packable(w) -> bool:
    return (
        isinstance(w, torch.Tensor) and w.dim() == 2 and w.device.type == "cpu" and w.dtype == torch.bfloat16
        and all(getattr(w, a, None) is None for a in (PACKED, AVX2_PACKED, THIN))
        and (onednn_bf16() or _avx2() is not None)
    )  # fmt: skip


def pack_pieces(model) -> list[list[torch.Tensor]]:
    """The bf16 CPU weights dense() reads from `model`: each layer's LINEARS, one piece a layer, then the lm_head."""
    pieces = [[w for n in getattr(layer, "LINEARS", ()) if packable(w := getattr(layer, n, None))] for layer in
              getattr(model, "layers", ())]  # fmt: skip
    head = getattr(model, "lm_head", None)
    return [p for p in [*pieces, [head] if packable(head) else []] if p]


PACK_HEADROOM = 1 << 30  # bytes a piece's copies must leave free: the steps' temporaries, the KV region's growth


def pack(weights: list[torch.Tensor], room=memory_room) -> int:
    """Give each weight its copy for the GEMM dense() runs it on from then on: the thin GEMM's (AVX512-BF16, the
    kernel loaded, the weight's shape fits), else oneDNN's packed copy; where oneDNN has no bf16 GEMM, its AVX2 GEMM
    panels instead. Only when the memory left (`room()`:
    bytes, None when unknown) holds them with PACK_HEADROOM to spare. Returns the bytes packed; 0 when the memory is
    short (then nothing is, the log says why, and the linears go on as before) or nothing packs here."""
    avx2 = _avx2()  # None wherever oneDNN has a bf16 GEMM
    if avx2 is None and not onednn_bf16():
        return 0
    thin = _thin()
    # (the AVX2 panels: the weight's bytes, its rows rounded up to a panel's columns; else one copy of its bytes)
    need = sum(-(-w.shape[0] // avx2.NR) * avx2.NR * w.shape[1] * 2 if avx2 else w.numel() * w.element_size()
               for w in weights)  # fmt: skip
    if (left := room()) is not None and left < need + PACK_HEADROOM:
        log.warning("CPU weight packing stopped: %d MiB left, its copies need %d MiB and %d to spare; the rest of "
                    "the linears stay unpacked", left >> 20, need >> 20, PACK_HEADROOM >> 20)  # fmt: skip
        return 0
    for w in weights:
        if avx2 is not None:
            setattr(w, AVX2_PACKED, avx2.pack(w))
        elif thin is not None and thin.fits(w):
            setattr(w, THIN, thin.pack(w))
        else:
            setattr(w, PACKED, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
    return need
