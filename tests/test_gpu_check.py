"""The GPU check's Python parts (bench/gpu_check.sh) run here in their --tiny form: the same code on CPU with a toy
model, the Triton kernels under the interpreter and the ReplayGraph stand-in, so the one script that runs on a GPU
does not rot between the rare runs on a GPU."""

from __future__ import annotations

import re

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


def test_hybrid_part(tmp_path):
    from bench import gpu_hybrid

    (line,) = gpu_hybrid.run(True, tmp_path)
    assert line.startswith("PASS hybrid (Qwen3-Next): eager, chunked prefill token-equal"), line


def test_cold_start(tmp_path):
    """Three engine starts in fresh processes (fp8 online, fp8 from its snapshot, bf16): each must start, read its
    weights from where it should, and be seen by the loader spy; any error recorded makes the line FAIL."""
    from bench import coldstart_gpu

    line = coldstart_gpu.run(tiny=True, where=str(tmp_path), child_timeout=240)
    assert line.startswith("PASS coldstart"), line


def test_versions_line_names_what_ran_and_the_image_pins():
    import torch

    (line,) = gpu_engine.versions(True)
    assert line.startswith(f"INFO versions: torch {torch.__version__}, triton "), line
    assert re.search(r"the image pins torch \d+\.\d+\.\d+ / triton \d+\.\d+\.\d+", line), line


FAKE_PY = """#!/usr/bin/env bash
# stands in for python3 on a GPU: each part of the check does what this test needs of it
case "$*" in
  *"import xdist"*) exit 0 ;;
  *"-m pytest"*) echo "[gw0] [ 50%] PASSED tests/kernels/test_a.py::ok"
                 echo "[gw1] [100%] FAILED tests/kernels/test_b.py::bad[1]"; exit 1 ;;
  *"gpu_engine versions"*) echo "INFO versions: torch x" ;;
  *"gpu_engine parity"*) echo "PASS parity: its own line" >>.gpu-results/summary.txt ;;
  *"gpu_engine start"*) echo "FAIL start: its own line" >>.gpu-results/summary.txt; exit 1 ;;
  *"gpu_hybrid"*) echo "PASS hybrid: its own line" >>.gpu-results/summary.txt ;;
  *"decode_step"*) echo "FAIL decode: printed, exit 0" ;;
  *"gpu_engine compiles"*) exit 3 ;;
  *"kernel_bench"*) echo "| rms_norm | 40% | >= 80% ❌ |" ;;
  *"coldstart_gpu"*) echo "PASS coldstart: its own line" >>.gpu-results/summary.txt ;;
esac
"""


def test_check_script_turns_every_recorded_error_into_a_fail(tmp_path):
    """bench/gpu_check.sh with a stand-in python: a part that exits 0 having printed a FAIL line, one that exits
    non-zero and a failing kernel test are each a FAIL in the summary; a doc's ❌ mark is not."""
    import shutil
    import subprocess
    from pathlib import Path

    (tmp_path / "bench").mkdir()
    shutil.copy(Path(__file__).parents[1] / "bench" / "gpu_check.sh", tmp_path / "bench")
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PY": str(fake)}
    subprocess.run(["bash", "bench/gpu_check.sh"], cwd=tmp_path, env=env, timeout=120, capture_output=True)
    summary = (tmp_path / ".gpu-results" / "summary.txt").read_text().splitlines()
    assert summary[0] == "INFO versions: torch x"
    assert summary[1:] == [
        "FAIL tests/kernels/test_b.py: 0 passed, 1 failed, 0 skipped",
        "PASS tests/kernels/test_a.py: 1 passed, 0 failed, 0 skipped",
        "PASS parity: its own line",
        "FAIL start: its own line",
        "PASS hybrid: its own line",
        "FAIL decode: exit 0, 1 FAIL line(s) in .gpu-results/decode.log",
        "FAIL compiles: exit 3, 0 FAIL line(s) in .gpu-results/compiles.log",
        "PASS kernel-bench",
        "PASS coldstart: its own line",
    ], summary
