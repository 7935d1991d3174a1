"""bf16 CPU linears packed for oneDNN (engine/layers/dense.py `pack`, run as IdleWork pieces after ready): the same
result bit for bit as the unpacked weight at every row count, and an engine whose weights got packed gives the same
tokens and logprobs as before. Where oneDNN has no bf16 GEMM for the CPU (AVX2 alone) the pieces pack the AVX2
GEMM's panels instead (tests/kernels/test_cpu_gemm_avx2.py); these tests skip there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import dense
from kernels.cpu_gemm import Avx2Gemm, ThinGemm
from tests.utils import unpacked_then_packed

ONEDNN_BF16 = dense.onednn_bf16()
needs_onednn_bf16 = pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN has no bf16 GEMM for this CPU (AVX2 alone)")


def test_onednn_bf16_follows_the_cpu_flags():
    """oneDNN's bf16 GEMM needs AVX-512 BW, VL and DQ, or AVX-NE-CONVERT (its error message says so on x86)."""
    import platform

    from kernels.cpu_build import cpu_flags

    flags = cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or not flags or not torch.backends.mkldnn.is_available():
        pytest.skip("x86 Linux with oneDNN only")
    assert ONEDNN_BF16 == ({"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags)


@pytest.fixture(autouse=True)
def onednn_alone(monkeypatch):
    """oneDNN's copy alone (bit for bit F.linear's): the thin GEMM's copies are tests/kernels/test_cpu_gemm.py's."""
    monkeypatch.setattr(ThinGemm, "loaded", classmethod(lambda cls: None))
    monkeypatch.setattr(Avx2Gemm, "loaded", classmethod(lambda cls: None))


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_weight_gives_the_unpacked_result_bit_for_bit(bias):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(96, 64, dtype=torch.bfloat16), requires_grad=False)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    xs = {rows: torch.randn(rows, 64, dtype=torch.bfloat16) for rows in (1, 3, 16, 17, 64, 100, 300)}
    before = {rows: dense.dense(x, w, b) for rows, x in xs.items()}
    assert dense.pack_pieces(torch.nn.Module()) == [] and dense.packable(w)
    assert dense.pack([w]) == w.numel() * 2
    assert not dense.packable(w)  # packed once
    for rows, x in xs.items():
        got = dense.dense(x, w, b)
        assert torch.equal(got, before[rows]), rows
        assert torch.equal(got, F.linear(x, w, b)), rows
    assert not dense.packable(w.float()) and not dense.packable(torch.zeros(4, dtype=torch.bfloat16))


@needs_onednn_bf16
def test_packing_stops_when_the_memory_left_would_not_hold_the_copies(caplog):
    w = torch.nn.Parameter(torch.randn(96, 64, dtype=torch.bfloat16), requires_grad=False)
    need = w.numel() * 2
    with caplog.at_level("WARNING", logger="engine"):
        assert dense.pack([w], room=lambda: dense.PACK_HEADROOM + need - 1) == 0
    assert not hasattr(w, dense.PACKED)
    assert "CPU weight packing stopped" in caplog.text
    assert dense.dense(torch.randn(3, 64, dtype=torch.bfloat16), w).shape == (3, 96)  # F.linear, as before
    assert dense.pack([w], room=lambda: dense.PACK_HEADROOM + need) == need
    w2 = torch.nn.Parameter(torch.randn(96, 64, dtype=torch.bfloat16), requires_grad=False)
    assert dense.pack([w2], room=lambda: None) == need  # unknown: packed, as before


@needs_onednn_bf16
def test_an_engine_packs_its_weights_after_ready_and_its_outputs_do_not_change(tiny_llama):
    from engine import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), dtype="bfloat16", kv_cache_memory=8 << 20, log_stats_interval=0)
    idle = llm.engine.idle
    model = llm.engine.runner.model
    assert len(idle.pack) == len(model.layers) + 1  # a layer a piece, then the lm_head
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    first, second = unpacked_then_packed(llm, params)
    assert idle.pack == [] and idle.packed > 0
    assert all(hasattr(getattr(layer, n), dense.PACKED) for layer in model.layers for n in layer.LINEARS)
    for a, b in zip(first, second):  # bit for bit
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@needs_onednn_bf16
def test_a_worker_engine_holds_the_packing_until_it_takes_jobs(tiny_llama):
    """AsyncEngine(idle_held=True), as the worker builds it: the host pieces run at once (warm_later), the packing
    waits for release_idle() (worker.ready(), after the runpod SDK's import, which the packing slowed 2x), then
    runs without a request."""
    import threading
    import time

    from engine import AsyncEngine, EngineConfig

    cfg = EngineConfig(model=str(tiny_llama), dtype="bfloat16", kv_cache_memory=8 << 20, log_stats_interval=0)
    engine = AsyncEngine(cfg, idle_held=True)
    try:
        idle, ran = engine.engine.idle, threading.Event()
        engine.warm_later(ran.set)
        assert ran.wait(10)  # a host piece is not held
        time.sleep(0.3)
        assert idle.held and idle.packed == 0 and idle.pack and not idle.pending
        engine.release_idle()
        deadline = time.monotonic() + 30
        while idle.pack and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not idle.held and not idle.pack and idle.packed > 0
    finally:
        engine.shutdown()
