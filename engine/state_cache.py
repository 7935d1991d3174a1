"""The state pool of a hybrid model (Qwen3-Next, Qwen3.5: engine/models/qwen3_next.py), beside the paged KV pool:
per linear-attention layer and per slot, a conv state [C, W - 1] (model dtype) and a recurrent state
[Hv, Dk, Dv] (fp32). A running sequence owns one slot (engine/state_slots.py) while it runs (a preempted one gives
it back and recomputes), so the pool's size is fixed by max_num_seqs, whatever the context length; the planner
counts it (engine/memory.py).

A step's rows of a sequence continue from its slot and leave the state after their last token there
(kernels/gated_delta.py). A sequence whose rows start at position 0 (its first chunk, or its recompute after a
preemption) starts from zeros: its slot is cleared first. Prefix caching is off for hybrid models, so no sequence
starts past position 0 without having computed the positions before it (docs/decisions.md, "Hybrid models")."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from engine.block_table import h2d_rows
from engine.models.spec import ModelSpec


@dataclass(frozen=True)
class StateBatch:
    """The pool and one step's sequences: rows query_start_loc[b]:query_start_loc[b + 1] use slot slots[b]."""

    conv: torch.Tensor  # [linear layers, slots, C, W - 1]
    rec: torch.Tensor  # [linear layers, slots, Hv, Dk, Dv] fp32
    query_start_loc: list[int] | torch.Tensor  # [B + 1]; int32 on the device where the kernels are Triton's
    slots: list[int] | torch.Tensor  # [B]


def state_shapes(spec: ModelSpec, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    la, n = spec.linear_attn, sum(spec.linear_layers)
    return (n, num_slots, la.conv_channels, la.conv_width - 1), (n, num_slots, la.v_heads, la.k_dim, la.v_dim)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on CPU a private anonymous map, whose pages cost memory only once a slot is used (as the KV pool's)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


class StatePool:
    """`num_slots` slots, plus with `spare` one more (the last) that CUDA graphs' padding sequences write into."""

    def __init__(self, spec: ModelSpec, num_slots: int, dtype: torch.dtype, device: torch.device, spare=False):
        self.args = spec, num_slots, dtype, device
        conv, rec = state_shapes(spec, num_slots + spare)
        self.conv = _zeros(conv, dtype, device)
        self.rec = _zeros(rec, torch.float32, device)
        self.nbytes = self.conv.nbytes + self.rec.nbytes
        self.spare = num_slots if spare else None
        self.on_device = device.type != "cpu"  # hand the kernels device indices, copied once a step (not per layer)

    def with_spare(self) -> StatePool:
        """This pool with a spare slot (before any step: nothing is copied)."""
        return self if self.spare is not None else StatePool(*self.args, spare=True)

    def batch(self, query_start_loc: list[int], positions: list[int], slots: list[int]) -> StateBatch:
        """This step's view of the pool; the slots of sequences starting at position 0 are cleared first."""
        fresh = _fresh(query_start_loc, positions, slots)
        if self.on_device:  # one pinned, asynchronous copy a step
            qsl, at, fresh = h2d_rows([list(query_start_loc), list(slots), fresh], torch.int64, self.conv.device)
            query_start_loc, slots = qsl.int(), at.int()
        self._clear(fresh)
        return StateBatch(self.conv, self.rec, query_start_loc, slots)

    def reset(self, query_start_loc: list[int], positions: list[int], slots: list[int]) -> None:
        """Clear the slots of sequences starting at position 0 (a CUDA graph's step: the graph reads its slots)."""
        if fresh := _fresh(query_start_loc, positions, slots):
            self._clear(h2d_rows([fresh], torch.int64, self.conv.device)[0])

    def _clear(self, slots) -> None:
        if len(slots):
            slots = slots if isinstance(slots, torch.Tensor) else torch.tensor(slots)
            self.conv.index_fill_(1, slots, 0)
            self.rec.index_fill_(1, slots, 0)

    def view(self, query_start_loc: torch.Tensor, slots: torch.Tensor) -> StateBatch:
        """The pool over a graph's static index buffers."""
        return StateBatch(self.conv, self.rec, query_start_loc, slots)


def _fresh(query_start_loc: list[int], positions: list[int], slots: list[int]) -> list[int]:
    """The slots of sequences whose rows start at position 0 (a first chunk, or a recompute)."""
    return [s for s, start in zip(slots, query_start_loc) if positions[start] == 0]


def scratch_state(spec: ModelSpec, num_tokens: int, dtype: torch.dtype, device: torch.device) -> StateBatch:
    """One sequence of `num_tokens` rows from a zero state, in a slot of its own (the fp8 KV calibration's forward,
    a warm-up step): nothing of the pool is touched."""
    conv, rec = state_shapes(spec, 1)
    z = torch.zeros
    return StateBatch(z(conv, dtype=dtype, device=device), z(rec, device=device), [0, num_tokens], [0])
