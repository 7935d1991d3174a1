"""bench.throughput --no-amx (bench/no_amx): the re-run process's pieces, without running the bench: its command line
and environment, torch telling every Python of the run that the CPU has no AMX tiles (what vLLM's CPU attention
asks), our kernels' builds losing AMX (a build keyed apart from the AMX one), a build that fails being an error, and
the CPUs and workloads it refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import no_amx
from kernels import cpu_build, cpu_gemm

AMX_Q = "import torch; print(torch.cpu._is_amx_tile_supported(), torch._C._cpu._is_amx_tile_supported())"
AMX_CPU = {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
REPO = Path(__file__).resolve().parents[1]


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


def test_the_command_is_run_again_with_onednn_capped_and_only_sitecustomize_added_to_the_path(monkeypatch):
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: AMX_CPU)
    monkeypatch.delenv(no_amx.MARK, raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-X", "utf8", "-m", "bench.throughput", "--no-amx"])
    calls = []

    def execve(exe, argv, env):
        calls.append((exe, argv, env))
        raise SystemExit(0)  # as the exec: nothing after it runs here

    monkeypatch.setattr(os, "execve", execve)
    with pytest.raises(SystemExit):
        no_amx.enter(Path("/nonexistent"))
    [(exe, argv, env)] = calls
    assert exe == sys.executable and argv == [sys.executable, "-X", "utf8", "-m", "bench.throughput", "--no-amx"]
    assert env[no_amx.MARK] == "1" and env["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(no_amx.HERE), "/elsewhere"]  # not the repository
    # marked but without the cap (a mark left in a shell): still run again, since oneDNN would not be capped
    monkeypatch.setenv(no_amx.MARK, "1")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    with pytest.raises(SystemExit):
        no_amx.enter(Path("/nonexistent"))
    assert len(calls) == 2


def test_the_rerun_builds_our_kernels_without_amx_or_fails_saying_why(monkeypatch, tmp_path):
    before = cpu_build.FLAGS
    monkeypatch.setattr(cpu_build, "FLAGS", before)  # given back after the test
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: AMX_CPU)
    monkeypatch.setenv(no_amx.MARK, "1")  # as in the re-run process: no second exec
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", no_amx.ISA)
    asked = []
    built = SimpleNamespace(lib=object(), error=None)
    monkeypatch.setattr(
        cpu_gemm.ThinGemm, "get", classmethod(lambda cls, d, wait=False: asked.append((d, wait)) or built)
    )
    no_amx.enter(tmp_path)
    assert cpu_build.FLAGS == before + no_amx.FLAGS  # after -march=native: the later flag wins
    assert asked == [(tmp_path, True)]  # built now, and waited for
    no_amx.enter(tmp_path)  # twice: each flag once
    assert cpu_build.FLAGS == before + no_amx.FLAGS
    built.lib, built.error = None, "cc: error: unrecognized command-line option '-mno-amx-tile'"
    with pytest.raises(SystemExit, match="did not build without AMX: cc: error"):
        no_amx.enter(tmp_path)


@pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler here")
def test_the_flags_leave_no_amx_in_a_native_build_and_key_it_apart(tmp_path):
    cc = cpu_build.compiler()
    cmd = [cc, "-march=native", *no_amx.FLAGS, "-dM", "-E", "-x", "c", "-"]
    macros = subprocess.run(cmd, input="", capture_output=True, text=True, timeout=60)
    assert macros.returncode == 0, macros.stderr  # the compiler knows every flag
    assert "__AMX_TILE__" not in macros.stdout and "__AMX_BF16__" not in macros.stdout
    assert "__AVX512FP16__" not in macros.stdout
    source = REPO / "kernels" / "cpu_gemm.c"
    amx = cpu_build.library_path(tmp_path, source, (), cc)
    flags = cpu_build.FLAGS
    try:
        cpu_build.FLAGS = flags + no_amx.FLAGS
        assert cpu_build.library_path(tmp_path, source, (), cc) != amx
    finally:
        cpu_build.FLAGS = flags


def test_cpus_it_cannot_help_are_told_why(monkeypatch):
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: {"avx2", "fma"})
    with pytest.raises(SystemExit, match="no AVX512-BF16"):
        no_amx.enter(Path("/nonexistent"))
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})  # AMD Zen 4, Zen 5
    with pytest.raises(SystemExit, match="has no AMX"):
        no_amx.enter(Path("/nonexistent"))


def test_no_amx_refuses_the_random_models(monkeypatch, capsys):
    from bench import throughput

    monkeypatch.setattr(sys, "argv", ["bench.throughput", "--no-amx", "--moe"])
    with pytest.raises(SystemExit) as e:
        throughput.main()
    assert e.value.code == 2 and "SmolLM2's workload only" in capsys.readouterr().err
