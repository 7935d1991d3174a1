"""bench/throughput_report.py's memory floor: the bytes a step-by-step engine must read, counted by hand."""

from __future__ import annotations

from types import SimpleNamespace

from bench._common import Workload
from bench.throughput_report import floors_paragraph, memory_floor


def test_the_memory_floor_counts_each_steps_weights_and_each_decodes_context():
    spec = SimpleNamespace(vocab_size=100, hidden_size=8, num_kv_layers=2, num_kv_heads=1, head_dim=4)
    wl = Workload([[1] * 5, [1] * 10], [3, 1])  # 3 steps at least; decodes see 5 + 1 and 5 + 2 tokens
    f = memory_floor(spec, wl, p_ne=1000, dtype_bytes=2, rate=1.0)
    kv_per_token = 2 * 2 * 1 * 4 * 2  # K and V x layers x kv heads x head_dim x bytes
    assert f["steps"] == 3 and f["weights"] == (1000 + 800) * 2 and f["kv"] == (6 + 7) * kv_per_token
    assert abs(f["seconds"] - (3 * 3600 + 13 * kv_per_token) / 1e9) < 1e-15
    f["shapes"] = {32: 100.0}
    text = floors_paragraph(f, gemm_floor=f["seconds"] / 2, ours=f["seconds"] * 2)
    assert f"The larger floor is {f['seconds']:.2f} s" in text and "**50.0 %**" in text
