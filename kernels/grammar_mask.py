"""The grammar mask: logits[r, t] = -inf where bit t of bitmask[r] is 0, for each row r in `rows`. The kernels are
xgrammar's own (its Triton kernel on CUDA, its C++ loop on CPU); on CUDA they run behind an operator
(kernels/_library.py), so the engine's CUDA path passes under fake tensors; the torch reference is beside them.

On CUDA the bitmask and the row indices reach the device from pinned memory without waiting for the stream:
xgrammar, given a list, would copy it from pageable memory, and CUDA waits for the stream before such a copy."""

from __future__ import annotations

import torch

from kernels._common import use_triton
from kernels._library import no_output, triton_op


def new_bitmask(rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, every token allowed (xgrammar's allocate_token_bitmask), on the host: pinned
    when it goes to a GPU."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32, pin_memory=device.type == "cuda")


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    # logits [S, V] fp32; bitmask [S, W] int32, bit j of word w is token 32 * w + j
    if not rows:
        return
    idx = torch.tensor(rows, device=logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device).index_select(0, idx)[:, :, None] >> shifts) & 1  # [R, W, 32]
    v = min(logits.shape[1], bits.shape[1] * 32)
    banned = bits.flatten(1)[:, :v] == 0  # [R, v]
    logits[idx, :v] = logits[idx, :v].masked_fill(banned, float("-inf"))


@triton_op("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor indices) -> ()", no_output)
def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """xgrammar's Triton kernel on CUDA; elsewhere (the interpreter's tests) its CPU loop."""
    if logits.is_cuda:
        from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_triton

        apply_token_bitmask_inplace_triton(logits, bitmask, indices=indices)
    else:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices.tolist())


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place. logits [S, V] fp32 on the device; bitmask [S, ceil(V / 32)] int32 on the host (new_bitmask)."""
    if not rows:
        return
    if not use_triton(logits):
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        return
    dev, pin = logits.device, logits.is_cuda
    indices = torch.tensor(rows, dtype=torch.int32, pin_memory=pin).to(dev, non_blocking=True)
    apply_bitmask_triton(logits, bitmask.to(dev, non_blocking=True), indices)
