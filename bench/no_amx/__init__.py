"""bench.throughput's --no-amx: the AVX512-BF16 path (an AMD Zen 4 or Zen 5's) timed on an Intel CPU that has AMX,
for ours and the peers that run on oneDNN, so a session on such a machine can still measure what an AMX-less CPU
runs.

- ours: the C kernels built with -mno-amx-* (their vdpbf16ps builds; kernels/cpu_build.py keys a build by its
  flags, so they sit beside the AMX builds) and without AVX512-FP16, which AMD's CPUs lack;
- oneDNN, torch's (ours and the HF peers) and vLLM's alike: capped at AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA);
- vLLM's CPU attention: its vector kernels, not its AMX ones (sitecustomize.py beside this file, which every Python
  of the run loads, tells torch the CPU has no AMX tiles);
- llama.cpp's server: its build is not changed.

Not AMD's balance: on the Xeon VM vdpbf16ps ran at about half the fp32 FMA's rate (docs/decisions.md), while Zen 4
and Zen 5 run it at twice their FMA's, so the whole workload is compute-bound there. Use it to compare engines on
the same path, not to predict an AMD machine's seconds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

MARK = "RP_BENCH_NO_AMX"  # set in the re-run process (and so in every peer it starts)
ISA = "AVX512_CORE_BF16"
FLAGS = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-mno-avx512fp16")
HERE = Path(__file__).resolve().parent


def rerun_env(env: dict[str, str]) -> dict[str, str]:
    """The re-run's environment: oneDNN capped, the mark, and this folder first on PYTHONPATH (for sitecustomize.py;
    not the repository: the peers' venvs must not see our packages)."""
    path = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    return env | {MARK: "1", "ONEDNN_MAX_CPU_ISA": ISA, "PYTHONPATH": path}


def enter(cache_dir: Path) -> None:
    """Re-run this process's command line (sys.orig_argv: `python -m bench.throughput ...`, with any interpreter
    options) in a process with rerun_env (oneDNN reads its cap once, as torch loads it: too late here); in that
    process, build our kernels AMX-less into `cache_dir` and fail with the compiler's message if they cannot be (the
    engine would fall back to oneDNN without a word). Exits with a message on a CPU without AMX or AVX512-BF16."""
    from kernels import cpu_build
    from kernels.cpu_gemm import ThinGemm

    flags = cpu_build.cpu_flags()
    if "avx512_bf16" not in flags:
        raise SystemExit("--no-amx: this CPU has no AVX512-BF16, so there is no AMX-less bf16 path to time")
    if not {"amx_tile", "amx_bf16"} <= flags:
        raise SystemExit("--no-amx: this CPU has no AMX; its runs take the AVX512-BF16 path already (drop the flag)")
    if os.environ.get(MARK) != "1" or os.environ.get("ONEDNN_MAX_CPU_ISA") != ISA:
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], rerun_env(dict(os.environ)))
    cpu_build.FLAGS = tuple(dict.fromkeys(cpu_build.FLAGS + FLAGS))
    gemm = ThinGemm.get(cache_dir, wait=True)
    if gemm.lib is None:
        raise SystemExit(f"--no-amx: our GEMM did not build without AMX: {gemm.error}")
