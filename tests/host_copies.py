"""Counts, on CPU tensors, the host-to-device copies that would make the host wait for a CUDA stream (test-only).

On CUDA a tensor indexed with a Python list (read or written; also a tuple holding a list, `t[i, [a, b]]`) builds
the index on the host and copies it with a stream sync (python_variable_indexing.cpp -> tensor_new.cpp's
internal_new_from_data -> a blocking `.to(device)`), and so does `torch.tensor(data, device=...)`.
engine.block_table.h2d stages through pinned memory instead, and its copy does not wait. On the CPU all of these
are plain ops, so they are told apart by how the code spells them:

- "list_index": a tensor indexed with a list;
- "tensor": torch.tensor(..., device=...) called anywhere but inside h2d (a host tensor made without a device is
  not a copy);
- "h2d": h2d calls (pinned, non-blocking on CUDA).

It cannot see `.to(device)` of a host tensor, nor a device-to-host read (.tolist(), .item(), .cpu(): the sampler
tests count those themselves)."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter

import torch

from engine import block_table


def _has_list(index) -> bool:
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


@contextlib.contextmanager
def count_host_copies():
    """Within the block: yields a Counter of "list_index", "tensor" and "h2d" (see the module doc)."""
    counts: Counter = Counter()
    get, set_, tensor = torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.tensor
    h2d_code = block_table.h2d.__code__

    def getitem(self, index):
        counts["list_index"] += _has_list(index)
        return get(self, index)

    def setitem(self, index, value):
        counts["list_index"] += _has_list(index)
        return set_(self, index, value)

    def make(*args, **kwargs):
        if sys._getframe(1).f_code is h2d_code:
            counts["h2d"] += 1
        elif "device" in kwargs:
            counts["tensor"] += 1
        return tensor(*args, **kwargs)

    # torch.Tensor inherits both methods from the C base class: set here, then deleted, which restores them
    torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.tensor = getitem, setitem, make
    try:
        yield counts
    finally:
        del torch.Tensor.__getitem__, torch.Tensor.__setitem__
        torch.tensor = tensor
        assert torch.Tensor.__getitem__ is get and torch.Tensor.__setitem__ is set_
