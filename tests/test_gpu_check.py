"""The GPU check's Python parts (bench/gpu_check.sh) run here in their --tiny form: the same code on CPU with a toy
model, the Triton kernels under the interpreter and the ReplayGraph stand-in, so the one script that runs on a GPU
does not rot between the rare runs on a GPU."""

from __future__ import annotations

import pytest

from bench import decode_step, gpu_engine

pytestmark = pytest.mark.slow  # the GPU check's tiny CPU forms, under the Triton interpreter


def test_decode_steps_eager_vs_graphs():
    rows = decode_step.measure(tiny=True, ctx=24, batches=(1, 2), reps=1)
    assert [(r["weights"], r["batch"]) for r in rows] == [("bf16", 1), ("bf16", 2), ("fp8", 1), ("fp8", 2)]
    assert all(r["tokens_equal"] for r in rows)
    assert rows[-1]["replays"] > 0 and rows[2]["weight_bytes"] < rows[0]["weight_bytes"]  # fp8 weights are smaller


@pytest.mark.parametrize("part", ["parity", "start", "compiles"])
def test_engine_parts(part, tmp_path):
    run = dict(parity=gpu_engine.parity, compiles=gpu_engine.compiles, start=lambda t, d: gpu_engine.start(t, d, 2))
    lines = run[part](True, tmp_path)
    assert lines and all(line.startswith("PASS") for line in lines), lines
