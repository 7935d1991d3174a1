"""Kernel tests run Triton on CPU through its interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before anything imports kernels), or for real on a GPU with KERNEL_TEST_DEVICE=cuda (bench/gpu_check.sh).

Tests draw their random inputs on CPU (seeded CPU generators: the same values on every device), then move what
the op consumes to DEVICE with `to_device` before calling the op and its reference."""

import os

import pytest
import torch

import kernels

# Where the ops under test run: cpu (Triton interpreter) or cuda (TRITON_INTERPRET=0). Tests may read the
# environment; product code may not.
DEVICE = torch.device(os.environ.get("KERNEL_TEST_DEVICE", "cpu"))

__all__ = ["ATTN_TOL", "DEVICE", "P_ROUNDED_TOL", "TOL", "assert_close", "to_device"]


def to_device(*tensors):
    """Each tensor (None passes through) moved to DEVICE; one argument gives one result, several a tuple."""
    out = tuple(t if t is None else t.to(DEVICE) for t in tensors)
    return out[0] if len(out) == 1 else out


# vLLM's tolerances
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1.3e-6),
    torch.bfloat16: dict(atol=1e-3, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
}

# Attention on a GPU rounds P to the 16-bit dtype for the tensor cores' PV dot (flash attention's trade): bf16's 8
# bits leave errors up to ~2e-3 at |v| ~ 1, past TOL's 1e-3 (fp16's 11 bits stay within it). fp32 is unchanged.
# The CPU attention's AVX512-BF16 build makes the same trade (kernels/cpu_attention_dot.h).
P_ROUNDED_TOL = dict(atol=4e-3, rtol=1.6e-2)
ATTN_TOL = {**TOL, torch.bfloat16: P_ROUNDED_TOL} if DEVICE.type == "cuda" else TOL


@pytest.fixture(autouse=True)
def triton_backend():
    kernels.set_backend("triton")
    yield
    kernels.set_backend("auto")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str = "", **tol) -> None:
    """torch.testing.assert_close, plus the first mismatching indices and values on failure."""
    tol = tol or TOL[expected.dtype]
    try:
        torch.testing.assert_close(actual, expected, **tol)
    except AssertionError as e:
        a, b = actual.float(), expected.float()
        bad = ~torch.isclose(a, b, atol=tol["atol"], rtol=tol["rtol"], equal_nan=False)
        idx = bad.nonzero()[:8].tolist()
        detail = ", ".join(f"{tuple(i)}: {a[tuple(i)].item():.6g} vs {b[tuple(i)].item():.6g}" for i in idx)
        raise AssertionError(f"{name}: {int(bad.sum())} mismatches, first {detail}\n{e}") from None
