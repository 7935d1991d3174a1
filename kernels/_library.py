"""Each Triton launcher as a torch operator, torch.ops.llmw.<name>, with a fake implementation beside it.

Why operators: under torch's FakeTensorMode (tests/fake_cuda.py runs the engine's CUDA path on a CPU-only machine
that way) and under torch.compile, a Python launcher cannot run: it reads strides, picks tiles and launches a
kernel on memory that does not exist. An operator's fake implementation says only what comes out (shapes, dtypes,
device), so both pass through. Registered with torch.library.Library's define/impl rather than
torch.library.custom_op: the call costs ~2 us instead of ~13 us (measured on this CPU), paid per layer per eager
step. The implementation is registered for CUDA and for CPU (the Triton interpreter in tests), so the same
operator runs in both."""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "llmw"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
IMPLS: dict[str, Callable] = {}  # name -> the launcher registered for it (tests/graph_standin.py runs it itself)


def triton_op(schema: str, fake: Callable) -> Callable[[Callable], torch._ops.OpOverload]:
    """Decorator: define llmw::<schema> with the decorated launcher as its CUDA and CPU implementation and `fake`
    as its fake one; returns the operator (call it as the launcher). Schema as torch's: `Tensor(a!) out` marks an
    argument written in place, `-> ()` an operator that returns nothing."""

    def register(impl: Callable) -> torch._ops.OpOverload:
        name = schema.split("(", 1)[0]
        IMPLS[name] = impl
        _LIB.define(schema)
        for key in ("CUDA", "CPU"):
            _LIB.impl(name, impl, key)
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
        return getattr(getattr(torch.ops, NAMESPACE), name).default

    return register


def no_output(*args, **kwargs) -> None:
    """The fake of an operator that only writes its arguments in place."""
    return None


# paged_attention and prefill_attention take the same arguments (their `_ref`s' and launchers' order)
ATTENTION_ARGS = (
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
    "float scale, Tensor? k_scale=None, Tensor? v_scale=None, int? max_query_len=None, int? num_splits=None, "
    "int? window=None, float? softcap=None, Tensor? sinks=None) -> Tensor"
)


def attention_fake(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return torch.empty_like(q)  # [T, H, D]
