"""The KV block pool with automatic prefix caching. Pure Python, so tests can assert exact block ids."""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable

from engine.types import Request

RUNS = True  # bench/ab.py's --ab block-runs switches it (off: the most recently freed block goes out first)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def hash_block(parent: bytes, token_ids: list[int], extra: tuple) -> bytes:
    """sha256 over (parent hash, the block's tokens, extra keys such as the adapter): a collision would
    serve one prompt's KV to another, so no weak hash (vLLM uses sha256 for the same reason)."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    h.update(repr(extra).encode())
    return h.digest()


class BlockManager:
    """Fixed-size blocks with ref counts, and a hash index over full blocks.

    - A full block of a caching request is registered under hash(parent, tokens, req.cache_key) when it
      is allocated for the step that fills it (each layer writes the step's KV before any attention
      reads it, so a request admitted in the same step may already share it).
    - A block whose ref count drops to 0 goes to the free queue but keeps its hash: it stays findable
      until it is handed out again (LRU: the least recently freed cached block goes first). Freed blocks
      without a hash hold nothing reusable and are handed out before any cached block: a request's next block is
      the one after its last where that one is free, else the lowest-numbered. A sequence's KV then lies in runs
      of consecutive blocks, which a CPU's decode attention reads faster (the lines past a block's end that the L2
      streamer fetches are the sequence's own): bench/cpu_attention.py's cold decode 1.08-1.13x against shuffled
      blocks on a Xeon (docs/decisions.md); RUNS off: the most recently freed goes out first, as before.
    - The partial last block of a sequence is never registered, so never shared.
    - With `chunk` (a CPU pool, whose pages cost memory only once touched), blocks are handed out from an open
      region [0, num_open) that starts as one chunk and grows by a chunk whenever an allocation would leave less
      free than a chunk or a quarter of the region (cached blocks count as free: they are evicted, LRU, inside the
      region before it grows). The region is then about 4/3 of the peak working set (at least that plus a chunk),
      and stops growing under a steady load.
      `on_open(num_open)` is told each growth (engine/kv_cache.py's Prefaulter faults the pages in ahead). The
      unopened blocks count as free: admission and preemption see the whole pool. chunk None: all open."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        chunk: int | None = None,
        on_open: Callable[[int], None] | None = None,
    ):
        if num_blocks < 1 or block_size < 1 or (chunk is not None and chunk < 1):
            raise ValueError(f"need num_blocks, block_size, chunk >= 1, got {num_blocks}, {block_size}, {chunk}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.chunk = chunk
        self.on_open = on_open
        self.num_open = num_blocks if chunk is None else min(chunk, num_blocks)
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_open))  # front = next out
        self.plain = list(range(self.num_open))  # heap: free blocks holding nothing cached (stale entries skipped)
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        # Speculative decoding with a draft model: 1 = the draft's KV pool holds this block's tokens too (set by the
        # draft, cleared when the block is handed out for new data), so a prefix-cache hit spares the draft as well
        self.draft_ready = bytearray(num_blocks)
        self.queried_tokens = 0  # prefix-cache stats: tokens looked up at admission, and found
        self.hit_tokens = 0
        self.evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the whole pool: the region's free queue and the blocks not opened yet."""
        return len(self.free_queue) + self.num_blocks - self.num_open

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def stats(self) -> dict:
        q = self.queried_tokens
        return {
            "prefix_cache_queried_tokens": q,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_hit_rate": self.hit_tokens / q if q else 0.0,
            "prefix_cache_blocks": len(self.cached),
            "prefix_cache_evictions": self.evictions,
            "kv_open_blocks": self.num_open,
        }

    # ---- prefix lookup --------------------------------------------------------------------
    def _block_hashes(self, req: Request, num_full: int) -> list[bytes]:
        """req's chained block hashes, extended to cover `num_full` full blocks (memoized on req:
        tokens are only ever appended, so earlier hashes stay valid across preemption)."""
        hs, bs = req.block_hashes, self.block_size
        while len(hs) < num_full:
            i = len(hs)
            hs.append(hash_block(hs[-1] if hs else b"", req.token_slice(i * bs, (i + 1) * bs), req.cache_key))
        return hs

    def find_cached(self, req: Request) -> list[int]:
        """The longest run of cached blocks at the start of req's tokens. At least one token is left to
        compute, since the step that computes it produces the logits to sample from."""
        if not req.cache_key:
            return []
        n = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in self._block_hashes(req, n)[:n]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    # ---- allocation -----------------------------------------------------------------------
    def allocate_slots(
        self, req: Request, num_new_tokens: int, cached_blocks: list[int] = (), num_lookahead: int = 0
    ) -> bool:
        """Grow req's block table to cover num_computed + len(cached_blocks) * block_size + num_new tokens, and
        `num_lookahead` slots past them for speculative drafts, taking `cached_blocks` (a hit from find_cached, for
        a request holding no blocks yet) first. Lookahead slots are never registered: only verified tokens are.

        Returns False, and changes nothing, when the pool cannot supply the blocks."""
        assert not cached_blocks or not req.block_ids, "cached blocks are only taken at admission"
        total = req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = blocks_needed(total + num_lookahead, self.block_size) - len(req.block_ids) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)  # these leave the free queue
        if need > self.num_free_blocks - revived:
            return False
        self._grow(need + revived)
        for block_id in cached_blocks:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1
            req.block_ids.append(block_id)
        for _ in range(need):
            block_id = self._take(req.block_ids[-1] + 1 if req.block_ids else None)
            self._forget(block_id)
            self.ref_counts[block_id] = 1
            req.block_ids.append(block_id)
        if req.cache_key:
            self._register(req, total // self.block_size)
        return True

    def _take(self, after: int | None) -> int:
        """A free block out of the queue: `after` (the block after the request's last) where it is free and holds
        nothing cached, else the lowest-numbered such block, else the least recently freed cached one."""
        if not RUNS:
            return self.free_queue.popitem(last=False)[0]
        if after is not None and self._plain_free(after):
            del self.free_queue[after]  # (its heap entry goes stale)
            return after
        while self.plain:
            block_id = heapq.heappop(self.plain)
            if self._plain_free(block_id):
                del self.free_queue[block_id]
                return block_id
        return self.free_queue.popitem(last=False)[0]

    def _plain_free(self, block_id: int) -> bool:
        return block_id in self.free_queue and self.block_hash[block_id] is None  # (a queued block has no owner)

    def _free_plain(self, block_id: int) -> None:
        """A free block that holds nothing: the front of the queue (handed out before any cached block)."""
        self.free_queue[block_id] = None
        self.free_queue.move_to_end(block_id, last=False)
        heapq.heappush(self.plain, block_id)

    def _grow(self, taking: int) -> None:
        """Open chunks while taking `taking` blocks from the region's free queue would leave it less than the
        headroom: a chunk, or a quarter of the region when that is more (room for cached prefixes that grows with
        the load). New blocks hold nothing cached: they go to the front of the queue."""
        opened = self.num_open
        while self.num_open < self.num_blocks and len(self.free_queue) - taking < max(self.chunk, self.num_open // 4):
            end = min(self.num_open + self.chunk, self.num_blocks)
            for block_id in range(end - 1, self.num_open - 1, -1):  # lowest id first out
                self._free_plain(block_id)
            self.num_open = end
        if self.num_open > opened and self.on_open is not None:
            self.on_open(self.num_open)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free req's blocks past the first `num_tokens` tokens (the slots of rejected drafts). Those blocks
        held only lookahead slots: never registered, never shared, so they are handed out first."""
        keep = blocks_needed(num_tokens, self.block_size)
        surplus = req.block_ids[keep:]
        # a new list, not the old one cut in place: DeviceBlockTable rewrites a row only when the table it
        # copied is replaced (an appended-to table is copied from where it left off)
        req.block_ids = req.block_ids[:keep]
        for block_id in reversed(surplus):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] == 0 and self.block_hash[block_id] is None, "a lookahead block is private"
            self._free_plain(block_id)

    def roll_back(self, req: Request) -> None:
        """A step that failed (out of memory) computed nothing: blocks past req's computed tokens hold no KV
        anyone may read. Their hashes (registered when the step allocated them) are forgotten, and the blocks past
        the computed ones go back to the pool, nothing to keep: handed out first."""
        computed_full = req.num_computed_tokens // self.block_size
        for block_id in req.block_ids[computed_full : req.num_registered_blocks]:
            h = self.block_hash[block_id]
            if h is not None and self.cached.get(h) == block_id:
                del self.cached[h]
            self.block_hash[block_id] = None
        req.num_registered_blocks = min(req.num_registered_blocks, computed_full)
        keep = blocks_needed(req.num_computed_tokens, self.block_size)
        surplus, req.block_ids = req.block_ids[keep:], req.block_ids[:keep]  # a new list (see trim)
        for block_id in reversed(surplus):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free_plain(block_id)

    def _register(self, req: Request, num_full: int) -> None:
        """Make req's first num_full blocks findable (they are full once this step has run)."""
        hashes = self._block_hashes(req, num_full)
        for i in range(req.num_registered_blocks, num_full):
            block_id, h = req.block_ids[i], hashes[i]
            if self.block_hash[block_id] is None and h not in self.cached:
                # (when h is cached already, an identical block exists elsewhere: keep that one)
                self.cached[h] = block_id
                self.block_hash[block_id] = h
        req.num_registered_blocks = max(req.num_registered_blocks, num_full)

    def _forget(self, block_id: int) -> None:
        """A free block is handed out for new data: drop its cached identity (an eviction)."""
        self.draft_ready[block_id] = 0
        h = self.block_hash[block_id]
        if h is not None:
            if self.cached.get(h) == block_id:
                del self.cached[h]
            self.block_hash[block_id] = None
            self.evictions += 1

    def free(self, req: Request) -> None:
        """Release every block of `req`. Tail blocks are released first, so under LRU they are evicted
        before the shared-prefix blocks that precede them."""
        for block_id in reversed(req.block_ids):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                if self.block_hash[block_id] is None:  # nothing to keep: reuse first
                    self._free_plain(block_id)
                else:
                    self.free_queue[block_id] = None  # back of the queue: evicted last
        req.block_ids = []
        req.num_registered_blocks = 0
