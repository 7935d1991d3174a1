"""The 16-bit dense linear of every model: F.linear, with the row count rounded up to a bucket on CPU.

oneDNN (torch's CPU bf16 GEMM) keeps what it builds for each distinct problem shape, and that memory is not given
back: about 150 KB per row count seen, per weight shape, even with its primitive cache off
(ONEDNN_PRIMITIVE_CACHE_CAPACITY=0). A step's row count is its token count, which takes every value from 1 to
MAX_NUM_BATCHED_TOKENS over a worker's life, so a serving worker's memory grew for hours (bench/soak.py, the memory
breakdown: anonymous memory outside the heap's free space). Rounding rows up to a bucket bounds the shapes: at most
16 + 15 + 1 per 64 rows past 256."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    if x.device.type != "cpu" or x.dim() != 2 or x.dtype == torch.float32 or (padded := bucket(rows)) == rows:
        return F.linear(x, w, bias)
    xp = x.new_empty(padded, x.shape[1])
    xp[:rows] = x
    xp[rows:] = 0
    return F.linear(xp, w, bias)[:rows]
