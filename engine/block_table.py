"""Host-to-device traffic of a step. `h2d`: lists to a device tensor through pinned memory. `DeviceBlockTable`: the
batch's block tables as one persistent device tensor (vLLM's BlockTable), for the Triton attention path and
the CUDA graphs. Rebuilding a padded tensor from Python lists every step cost O(batch x longest table) ints and
blocking copies; here each step writes only what changed into a pinned host mirror and sends the batch's rows
with one non-blocking copy.

A request's `block_ids` list only grows while it runs; preemption replaces it with a new list (BlockManager.free),
so "same list object as last step in this row" means "its first `filled` entries are already written"."""

from __future__ import annotations

import torch


def h2d(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or list of equal-length lists) as a tensor on `device`. On CUDA it is staged in pinned memory
    (torch's caching host allocator), so the non-blocking copy really is asynchronous: from pageable memory it
    would be staged synchronously."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def h2d_rows(rows: list[list[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Several host lists in ONE copy, returned as views that each start 16-byte aligned: Triton compiles a
    separate variant for a pointer that is not (a view at an odd offset would cost a compile mid-request)."""
    per = 16 // torch.empty((), dtype=dtype).element_size()
    widths = [len(r) + (-len(r)) % per for r in rows]
    flat = [v for r, w in zip(rows, widths) for v in r + [0] * (w - len(r))]
    packed, out, at = h2d(flat, dtype, device), [], 0
    for r, w in zip(rows, widths):
        out.append(packed[at : at + len(r)])
        at += w
    return out


class DeviceBlockTable:
    def __init__(self, max_rows: int, max_blocks: int, device: torch.device):
        on_cuda = device.type == "cuda"
        # [max_rows, max_blocks] int32; on CPU the host mirror is the table itself
        self.host = torch.zeros((max_rows, max_blocks), dtype=torch.int32, pin_memory=on_cuda)
        self.table = torch.zeros_like(self.host, device=device) if on_cuda else self.host
        self._owner: list[list[int] | None] = [None] * max_rows  # the block_ids list each row mirrors
        self._filled = [0] * max_rows
        self._copied = torch.cuda.Event() if on_cuda else None
        self.entries_written = 0  # host entries written so far (tests check the incremental update)
        self.copies = 0  # updates that wrote rows: on CUDA each waits for the previous copy, then sends its own

    @property
    def max_blocks(self) -> int:
        return self.host.shape[1]

    def update(self, tables: list[list[int]]) -> torch.Tensor:
        """Mirror `tables` (row i = the batch's i-th sequence) and return the device table's first len(tables) rows,
        full width: [B, max_blocks] int32. Entries past a row's table are stale; attention never reads them.
        When no row changed (a draft model's one-token steps) nothing is written, copied or waited for: every row
        written before was copied with it, and copies run in stream order."""
        b, wrote = len(tables), False
        for row, ids in enumerate(tables):
            start = self._filled[row] if self._owner[row] is ids else 0
            if start < len(ids):
                if not wrote and self._copied is not None:
                    self._copied.synchronize()  # the last copy may still read the host rows (a step need not sync)
                wrote = True
                self.host[row, start : len(ids)] = torch.tensor(ids[start:], dtype=torch.int32)
                self.entries_written += len(ids) - start
            self._owner[row], self._filled[row] = ids, len(ids)
        if wrote:
            self.copies += 1
            if self.table is not self.host:
                self.table[:b].copy_(self.host[:b], non_blocking=True)
                self._copied.record()
        return self.table[:b]
