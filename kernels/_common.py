"""What every kernel file shares: the backend dispatch (which path an op takes), Triton helpers and constants.

Dispatch: each public op runs the Triton launcher on CUDA tensors and the torch reference elsewhere.
`set_backend("triton")` forces the Triton path on CPU too (only meaningful under TRITON_INTERPRET=1, which
the tests set before importing this package); `set_backend("torch")` forces the references. The engine
uses `backend(name)`, a per-thread override, so two engines in one process cannot change each other.

`round_to` is the fp32 -> x.dtype rounding every kernel here uses: Triton's interpreter casts fp32 -> bf16 by
truncation (even with fp_downcast_rounding="rtne"), while torch and the GPU round to nearest even, so bf16
rounding is done with integer ops that give RNE everywhere."""

from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value

_BACKEND = "auto"  # auto | torch | triton
_local = threading.local()


def set_backend(name: str) -> None:
    global _BACKEND
    _BACKEND = _check(name)


@contextlib.contextmanager
def backend(name: str):
    """Use `name` for ops called from this thread inside the block."""
    prev = getattr(_local, "mode", None)
    _local.mode = _check(name)
    try:
        yield
    finally:
        _local.mode = prev


def _check(name: str) -> str:
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"kernel backend must be auto, torch or triton, not {name!r}")
    return name


def use_triton(t) -> bool:
    """True when `t`'s op should run the Triton kernel."""
    mode = getattr(_local, "mode", None) or _BACKEND
    if mode == "torch":
        return False
    return mode == "triton" or t.is_cuda


@triton.jit
def round_to(x, DT: tl.constexpr):
    """fp32 `x` rounded to dtype DT (nearest even), returned as fp32; `.to(DT)` of the result is exact."""
    if DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)  # round half to even at bit 16
        r = ((b >> 16) << 16).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)  # keep NaN a NaN
    elif DT == tl.float32:
        return x
    else:
        return x.to(DT).to(tl.float32)  # fp16: the interpreter's numpy cast already rounds to nearest even
