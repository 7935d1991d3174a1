"""Quiet fallbacks are not quiet: where the platform refuses a guarantee we rely on (no orphaned ranks, bounded
malloc arenas, a pre-faulted KV pool), the process says so at warning level, once."""

import ctypes
import logging

import torch

from engine import kv_cache
from engine.parallel import worker
from handler import settings


class _FailingLibc:
    """A libc whose calls all report failure the way glibc does (prctl/madvise -1, mallopt 0)."""

    def prctl(self, *a):
        return -1

    def madvise(self, *a):
        return -1

    def mallopt(self, *a):
        return 0


def _warnings(caplog, needle):
    return [r for r in caplog.records if r.levelno == logging.WARNING and needle in r.getMessage()]


def test_prctl_failure_is_logged(monkeypatch, caplog):
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: _FailingLibc())
    with caplog.at_level(logging.WARNING):
        worker._die_with_parent()
    assert len(_warnings(caplog, "PR_SET_PDEATHSIG")) == 1


def test_mallopt_failure_is_logged(monkeypatch, caplog):
    monkeypatch.setattr(settings.sys, "platform", "linux")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: _FailingLibc())
    with caplog.at_level(logging.WARNING):
        settings._limit_malloc_arenas(2)
    assert len(_warnings(caplog, "M_ARENA_MAX")) == 1


def test_kv_prefault_failure_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(kv_cache, "_prefault_warned", False)
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: _FailingLibc())
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # three pools (a target and drafts): one line
            pf = kv_cache.Prefaulter(4, chunk=1)
            pool = pf.zeros((2, 2, 1, 4, 16, 8), torch.float32)
            pf.open(2)
            pf.wait()
            assert not pool.any()  # pages fault in on first use: still zeros
    assert len(_warnings(caplog, "pre-fault unavailable")) == 1


def test_a_successful_call_says_nothing(caplog):
    """This machine is Linux with glibc: the real mallopt succeeds and nothing is logged. (prctl is not called
    for real here: it would tie the test process's life to its parent's.)"""
    with caplog.at_level(logging.WARNING):
        settings._limit_malloc_arenas(8)
    assert not _warnings(caplog, "M_ARENA_MAX")
