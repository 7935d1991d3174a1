"""RMSNorm, computed in fp32 like HF so fp32/bf16 outputs match it bit for bit."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., hidden]
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then normalize it. Returns (normed, new residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual
