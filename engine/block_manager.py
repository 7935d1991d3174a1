"""The KV block pool: which physical blocks each request holds. Pure Python, so tests can assert exact ids."""
from __future__ import annotations

from collections import deque

from engine.types import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Fixed-size blocks handed out from a FIFO free list, with a ref count per block.

    A request holds exactly ceil(tokens / block_size) blocks, so the waste is at most one partly
    filled block per request. Ref counts exist so blocks can later be shared (prefix caching, n > 1)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Grow `req`'s block table to cover num_computed + num_new tokens.

        Returns False, and changes nothing, when the pool cannot supply the blocks."""
        need = blocks_needed(req.num_computed_tokens + num_new_tokens, self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if need > len(self.free_ids):
            return False
        for _ in range(need):
            block_id = self.free_ids.popleft()
            self.ref_counts[block_id] = 1
            req.block_ids.append(block_id)
        return True

    def free(self, req: Request) -> None:
        """Release every block of `req`. Freed blocks go to the back of the free list."""
        for block_id in reversed(req.block_ids):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self.free_ids.append(block_id)
        req.block_ids = []
