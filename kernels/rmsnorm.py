"""RMSNorm and fused residual-add + RMSNorm: Triton kernel, launcher and torch reference.

Math (HF, and the engine on CPU): h = x.float(); h = h * rsqrt(mean(h^2) + eps); out = weight * h.to(x.dtype).
The multiply by weight happens after the cast back to x.dtype, so the kernel rounds h to x.dtype before it
multiplies. The product of two bf16/fp16 values is exact in fp32, so one rounding to the output dtype matches
torch bit for bit; only the fp32 row sum differs in order.

Every fp32 -> x.dtype rounding uses _common.round_to (nearest even, also under the interpreter).
"""

from __future__ import annotations

import torch

from kernels import cpu_ops
from kernels._common import jit, next_power_of_2, round_to, tl, use_triton
from kernels._library import triton_op


@jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row. x/res/out rows: [hidden], contiguous in the last dim.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dt = x_ptr.dtype.element_ty
    out_dt = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # residual + x in x.dtype: fp32 add then one rounding (innocuous double rounding for bf16/fp16)
        h = round_to(h + r, dt)
        tl.store(res_out_ptr + row * stride_res_out + cols, h.to(dt), mask=mask)
    var = tl.sum(h * h, axis=0) / hidden
    h = round_to(h * tl.rsqrt(var + eps), dt)  # h.to(x.dtype), as the reference does
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(w * h, out_dt).to(out_dt), mask=mask)


def _as_rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    rows = t.reshape(-1, hidden)  # [N, hidden]; a view whenever the leading dims allow it
    assert rows.stride(-1) == 1, "last dim must be contiguous"
    return rows


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous(), f"weight {tuple(weight.shape)} vs hidden {hidden}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    assert weight.device == x.device
    x2 = _as_rows(x, hidden)  # [N, hidden]
    n = x2.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, hidden)  # [N, hidden]
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        r2 = _as_rows(residual, hidden)  # [N, hidden]
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = res_out.view(-1, hidden)  # [N, hidden]
    else:
        r2 = ro2 = res_out = x2  # unused (HAS_RESIDUAL=False)
    if n > 0:
        _rms_norm_kernel[(n,)](
            x2,
            r2,
            weight,
            out2,
            ro2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            ro2.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=next_power_of_2(hidden),
        )
    return out, (res_out if residual is not None else None)


@triton_op("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", lambda x, weight, eps: _fake(x, weight))
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def _fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


@triton_op(
    "add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    lambda x, residual, weight, eps: (_fake(x, weight), torch.empty_like(x)),
)
def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes new tensors; x and residual are not modified."""
    return _launch(x, residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., hidden], weight: [hidden]
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x  # [..., hidden]
    return rms_norm_ref(residual, weight, eps), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> [..., hidden]."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    if (lib := cpu_ops.library(x, weight)) is not None:  # bf16 on CPU, once the C op is loaded
        return cpu_ops.add_rms_norm(lib, x, None, weight, eps)[0]
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(residual + x), residual + x) as new tensors; inputs are not modified."""
    if use_triton(x):
        return add_rms_norm_triton(x, residual, weight, eps)
    if (lib := cpu_ops.library(x, residual, weight)) is not None:  # bf16 on CPU, once the C op is loaded
        return cpu_ops.add_rms_norm(lib, x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)
