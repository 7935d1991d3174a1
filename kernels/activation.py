"""Gated activations of the MLPs: SiLU-and-mul (Llama's SwiGLU), GELU(tanh)-and-mul (Gemma's GeGLU) and GPT-OSS's
clamped SwiGLU. One Triton kernel (the activation a constexpr), launchers and torch references.

Math (act(gate) * up in x.dtype): the activation is computed in fp32 and rounded to x.dtype, then the product with
`up` is rounded to x.dtype again. The kernel does the same two roundings
(with _common.round_to, which rounds bf16 to nearest even under the interpreter too). GELU's tanh approximation:
0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(y) = 2 sigmoid(2y) - 1.
GPT-OSS (transformers' GptOssExperts): gate = min(gate, limit), up = clamp(up, -limit, limit),
act = gate * sigmoid(alpha * gate), out = (up + 1) * act; `up + 1` is rounded to x.dtype too (as HF's, in the
model dtype), so in fp32 it is HF's formula exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels._common import cdiv, jit, next_power_of_2, round_to, tl, use_triton
from kernels._library import triton_op

SILU, GELU_TANH, SWIGLU_OAI = 0, 1, 2  # the kernel's ACT (literals in its body: Triton is not imported yet)


@jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, inter, alpha, limit, ACT: tl.constexpr, BLOCK: tl.constexpr
):
    # grid (T, cdiv(I, BLOCK)); x row: [2*I] = [gate | up], out row: [I]; alpha, limit: SWIGLU_OAI's only
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    dt = out_ptr.dtype.element_ty
    if ACT == 1:  # GELU_TANH: F.gelu(gate, approximate="tanh")
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = round_to(0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0)), dt)
    elif ACT == 2:  # SWIGLU_OAI, GPT-OSS: clamped gate and up, up + 1
        gate = tl.minimum(gate, limit)
        up = round_to(tl.minimum(tl.maximum(up, -limit), limit) + 1.0, dt)
        act = round_to(gate * tl.sigmoid(alpha * gate), dt)
    else:  # SILU: F.silu
        act = round_to(gate / (1.0 + tl.exp(-gate)), dt)
    tl.store(out_ptr + row * stride_out + cols, round_to(act * up, dt).to(dt), mask=mask)


@triton_op(
    "act_and_mul(Tensor x, bool gelu=False, float[]? swiglu=None) -> Tensor",
    lambda x, gelu=False, swiglu=None: x.new_empty((x.shape[0], x.shape[1] // 2)),
)
def silu_and_mul_triton(x: torch.Tensor, gelu: bool = False, swiglu=None) -> torch.Tensor:
    """SiLU, GELU-tanh (gelu) or GPT-OSS's clamped SwiGLU (swiglu = (alpha, limit)) and mul."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2*I], got {tuple(x.shape)}"
    assert x.stride(1) == 1, "last dim must be contiguous"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    assert not (gelu and swiglu is not None), "one activation"
    t, inter = x.shape[0], x.shape[1] // 2
    act = SWIGLU_OAI if swiglu is not None else GELU_TANH if gelu else SILU
    alpha, limit = (float(v) for v in swiglu) if swiglu is not None else (0.0, 0.0)
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)  # [T, I]
    if t > 0 and inter > 0:
        block = min(1024, next_power_of_2(inter))
        grid = (t, cdiv(inter, block))
        _act_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), inter, alpha, limit, ACT=act, BLOCK=block)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2*I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] -> silu(x[:, :I]) * x[:, I:], [T, I]. On CPU in bf16, the C op once loaded (kernels/cpu_ops.py)."""
    if use_triton(x):
        return silu_and_mul_triton(x)
    if (lib := cpu_ops.library(x)) is not None and (out := cpu_ops.silu_and_mul(lib, x)) is not None:
        return out
    return silu_and_mul_ref(x)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2*I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] -> gelu_tanh(x[:, :I]) * x[:, I:], [T, I] (Gemma's MLP)."""
    return silu_and_mul_triton(x, gelu=True) if use_triton(x) else gelu_tanh_and_mul_ref(x)


def swiglu_oai_and_mul_ref(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    # x: [T, 2*I] -> [T, I]; the activation in fp32, rounded once; up + 1 and the product in x.dtype
    gate, up = x.chunk(2, dim=-1)
    gate = gate.float().clamp(max=limit)
    act = (gate * torch.sigmoid(gate * alpha)).to(x.dtype)
    return (up.clamp(-limit, limit) + 1) * act


def swiglu_oai_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """x: [T, 2*I] = [gate | up] -> (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), [T, I]
    (GPT-OSS's experts; alpha 1.702, limit 7.0 there)."""
    if use_triton(x):
        return silu_and_mul_triton(x, False, [float(alpha), float(limit)])
    return swiglu_oai_and_mul_ref(x, alpha, limit)
