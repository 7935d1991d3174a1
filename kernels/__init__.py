"""Triton kernels for the hot path, each in its own file beside its torch reference (`<op>_ref`). Which path an
op takes (Triton or the reference) is decided in _common.py: `set_backend`, `backend`, `use_triton`. Triton itself is
imported by `load_triton()`, at the engine's start on the Triton path or at the first launch: never on the CPU
worker's path."""

from kernels._common import FP8_MAX, backend, load_triton, set_backend, use_triton
from kernels.activation import silu_and_mul
from kernels.cache_write import reshape_and_cache
from kernels.fp8 import fp8_linear, quant_per_channel, quant_per_token
from kernels.lora import add_lora, lora_expand, lora_shrink, slot_groups
from kernels.paged_attention import paged_attention
from kernels.prefill_attention import prefill_attention
from kernels.rmsnorm import add_rms_norm, rms_norm
from kernels.rotary import rotary_embedding

__all__ = [
    "FP8_MAX",
    "add_lora",
    "add_rms_norm",
    "backend",
    "fp8_linear",
    "load_triton",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "prefill_attention",
    "quant_per_channel",
    "quant_per_token",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "set_backend",
    "silu_and_mul",
    "slot_groups",
    "use_triton",
]
