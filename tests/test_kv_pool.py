"""The CPU KV pool: zero pages from an anonymous mmap, faulted in by a background thread after the start."""

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


def _rss() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024


def _populate_supported() -> bool:
    buf = mmap.mmap(-1, 1 << 16)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    ok = ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(addr), ctypes.c_size_t(1 << 16), 23) == 0
    return ok


@pytest.mark.skipif(sys.platform != "linux", reason="anonymous mmap + madvise: Linux only")
def test_cpu_pool_is_faulted_in_in_the_background():
    if not _populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14): pages fault in on first use")
    size = 96 << 20
    before = _rss()
    pool = kv_cache._cpu_hugepage_zeros((96, 1 << 20), torch.uint8)
    deadline = time.monotonic() + 20
    while _rss() - before < size * 0.9 and time.monotonic() < deadline:  # no access from here: only the thread
        time.sleep(0.05)
    assert _rss() - before >= size * 0.9, f"{(_rss() - before) / 2**20:.0f} MiB resident of {size / 2**20:.0f}"
    assert pool.shape == (96, 1 << 20) and not pool.any()  # still zeros
