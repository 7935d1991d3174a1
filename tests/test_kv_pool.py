"""The CPU KV pool: zero pages from an anonymous mmap, faulted in by a background thread (engine/kv_cache.py's
Prefaulter): the whole pool for a fixed one, else the block manager's open region and a chunk ahead of it."""

from __future__ import annotations

import ctypes
import mmap
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import kv_cache

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="anonymous mmap + madvise: Linux only")
PAGE = mmap.PAGESIZE


def _rss() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024


def _populate_supported() -> bool:
    buf = mmap.mmap(-1, 1 << 16)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    ok = ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(addr), ctypes.c_size_t(1 << 16), 23) == 0
    return ok


@pytest.fixture(autouse=True)
def _needs_populate():
    if not _populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14): pages fault in on first use")


def _resident(t: torch.Tensor) -> list[int]:
    """mincore: 1 for each page of `t` that is in memory (the test never reads the pool: a read would map pages)."""
    addr, n = t.data_ptr(), t.numel() * t.element_size()
    assert addr % PAGE == 0
    vec = (ctypes.c_ubyte * -(-n // PAGE))()
    assert ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), vec) == 0
    return [v & 1 for v in vec]


def _resident_blocks(t: torch.Tensor) -> list[set[int]]:
    """Per segment (layer, K/V, head): the blocks in memory, for a pool whose block is one page per segment."""
    segments, blocks = t.shape[0] * t.shape[1] * t.shape[2], t.shape[3]
    assert t[0, 0, 0, 0].numel() * t.element_size() == PAGE
    pages = _resident(t)
    return [{b for b in range(blocks) if pages[s * blocks + b]} for s in range(segments)]


def test_a_fixed_pool_is_faulted_in_whole_in_the_background():
    size = 96 << 20
    before = _rss()
    pool = kv_cache.Prefaulter(1 << 10).zeros((6, 2, 2, 1 << 10, 16, 256), torch.uint8)  # 96 MiB, chunk None
    deadline = time.monotonic() + 20
    while _rss() - before < size * 0.9 and time.monotonic() < deadline:  # no access from here: only the thread
        time.sleep(0.05)
    assert _rss() - before >= size * 0.9, f"{(_rss() - before) / 2**20:.0f} MiB resident of {size / 2**20:.0f}"
    assert pool.shape == (6, 2, 2, 1 << 10, 16, 256) and not pool.any()  # still zeros


def test_each_pool_is_faulted_in_a_chunk_ahead_of_the_open_region():
    """Exactly blocks [0, open + chunk) of every segment, for the target's pool and the draft's, and nothing past
    them: at first the first region (one chunk) and a chunk ahead, then a chunk past each opened region."""
    blocks, chunk = 64, 8
    pf = kv_cache.Prefaulter(blocks, chunk)
    shape = (2, 2, 2, blocks, 16, PAGE // 64)  # fp32: one page per block per segment, 8 segments
    target, draft = pf.zeros(shape, torch.float32), pf.zeros((3, 2, 1, blocks, 16, PAGE // 64), torch.float32)
    pf.wait()
    for pool in (target, draft):
        assert _resident_blocks(pool) == [set(range(16))] * (pool.shape[0] * pool.shape[1] * pool.shape[2])
    pf.open(20)  # the region is now [0, 20): [0, 28) populated
    pf.wait()
    assert _resident_blocks(target) == [set(range(28))] * 8
    pf.open(12)  # less than what is populated: nothing to do
    pf.open(60)  # a chunk past it is past the pool: up to its end
    pf.wait()
    assert _resident_blocks(target) == [set(range(blocks))] * 8
    assert _resident_blocks(draft) == [set(range(blocks))] * 6
    assert pf._thread is None  # the thread ends when nothing is left: a dropped engine's pools are freed


def test_growth_chunk_is_16_mib_of_kv_within_the_pool():
    from engine.memory import MemoryPlan

    def plan(blocks: int, per_token: int) -> MemoryPlan:
        return MemoryPlan(0, 0, 0, 0, 0, per_token, 16, blocks, 2048)

    assert kv_cache.growth_chunk(plan(10_000, 23040)) == (16 << 20) // (23040 * 16) == 45  # SmolLM2-135M, bf16
    assert kv_cache.growth_chunk(plan(30, 23040)) == 30  # at most the pool
    assert kv_cache.growth_chunk(plan(100, 8 << 20)) == 1  # at least one block
