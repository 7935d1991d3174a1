"""bench.throughput --no-amx (bench/no_amx): the re-run process's pieces, without running the bench: torch tells every
Python of the run that the CPU has no AMX tiles (what vLLM's CPU attention asks), our kernels' builds get AMX-less
flags, and a CPU without AVX512-BF16 is told why there is nothing to time."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import no_amx
from kernels import cpu_build

AMX_Q = "import torch; print(torch.cpu._is_amx_tile_supported(), torch._C._cpu._is_amx_tile_supported())"


def test_every_python_of_the_run_is_told_the_cpu_has_no_amx_tiles():
    env = os.environ | {"PYTHONPATH": str(no_amx.HERE), no_amx.MARK: "1"}
    out = subprocess.run([sys.executable, "-c", AMX_Q], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
    # without the mark the same sitecustomize leaves torch alone (a venv's other Pythons are not touched)
    env.pop(no_amx.MARK)
    plain = subprocess.run([sys.executable, "-c", AMX_Q], env=env, capture_output=True, text=True, timeout=120)
    bare = subprocess.run([sys.executable, "-c", AMX_Q], capture_output=True, text=True, timeout=120)
    assert plain.stdout == bare.stdout


def test_the_rerun_builds_our_kernels_without_amx(monkeypatch):
    before = cpu_build.FLAGS
    monkeypatch.setattr(cpu_build, "FLAGS", before)  # given back after the test
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    monkeypatch.setenv(no_amx.MARK, "1")  # as in the re-run process: no second exec
    no_amx.enter(["bench.throughput", "--no-amx"])
    assert cpu_build.FLAGS == before + no_amx.FLAGS  # after -march=native: the later flag wins
    no_amx.enter(["bench.throughput", "--no-amx"])  # twice: each flag once
    assert cpu_build.FLAGS == before + no_amx.FLAGS


def test_a_cpu_without_avx512_bf16_is_told_why(monkeypatch):
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: {"avx2", "fma"})
    with pytest.raises(SystemExit, match="no AVX512-BF16"):
        no_amx.enter(["bench.throughput", "--no-amx"])
