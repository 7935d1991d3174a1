"""A hybrid model's state slots (engine/state_cache.py holds the tensors): one per running sequence, taken when the
scheduler admits it and given back when it finishes or is preempted (it then recomputes from its prompt, from a
zero state). Pure Python, as the block manager."""

from __future__ import annotations

import heapq

from engine.types import Request


class StateSlots:
    """`num_slots` slots (max_num_seqs: the scheduler never runs more sequences), the lowest free one first, so a
    CPU pool's pages are touched only up to the peak number of sequences that ran together."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots))  # a heap

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, req: Request) -> None:
        if req.state_slot < 0:
            req.state_slot = heapq.heappop(self.free)

    def give_back(self, req: Request) -> None:
        if req.state_slot >= 0:
            heapq.heappush(self.free, req.state_slot)
            req.state_slot = -1
