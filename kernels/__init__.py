"""Triton kernels for the hot path, each in its own file beside its torch reference (`<op>_ref`).

Dispatch: each public op runs the Triton launcher on CUDA tensors and the torch reference elsewhere.
`set_backend("triton")` forces the Triton path on CPU too (only meaningful under TRITON_INTERPRET=1, which
the tests set before importing this package); `set_backend("torch")` forces the references. The engine
uses `backend(name)`, a per-thread override, so two engines in one process cannot change each other."""
from __future__ import annotations

import contextlib
import threading

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


# The ops (imported last: each module imports this package for use_triton).
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.cache_write import reshape_and_cache  # noqa: E402
from kernels.fp8 import fp8_linear, quant_per_channel, quant_per_token  # noqa: E402
from kernels.lora import add_lora, lora_expand, lora_shrink, slot_groups  # noqa: E402
from kernels.paged_attention import paged_attention  # noqa: E402
from kernels.rmsnorm import add_rms_norm, rms_norm  # noqa: E402
from kernels.rotary import rotary_embedding  # noqa: E402

__all__ = ["add_lora", "add_rms_norm", "backend", "fp8_linear", "lora_expand", "lora_shrink", "paged_attention",
           "quant_per_channel", "quant_per_token", "reshape_and_cache", "rms_norm", "rotary_embedding", "set_backend",
           "silu_and_mul", "slot_groups", "use_triton"]
