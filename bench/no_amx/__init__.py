"""bench.throughput's --no-amx: the AVX512-BF16 path (an AMD Zen 4 or Zen 5's) timed on an Intel CPU that has AMX,
ours and the peers alike, so a session on such a machine can still measure what an AMX-less CPU runs.

- ours: the C kernels built with -mno-amx-* (their vdpbf16ps builds; kernels/cpu_build.py keys a build by its
  flags, so they sit beside the AMX builds) and without AVX512-FP16, which AMD's CPUs lack;
- oneDNN, torch's and vLLM's alike: capped at AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA);
- vLLM's CPU attention: its vector kernels, not its AMX ones (sitecustomize.py beside this file, which every Python
  of the run loads, tells torch the CPU has no AMX tiles).

Not AMD's balance: on the Xeon VM vdpbf16ps ran at about half the fp32 FMA's rate (docs/decisions.md), while Zen 4
and Zen 5 run it at twice the FMA's, so the whole workload is compute-bound here. Use it to compare engines on the
same path, not to predict an AMD machine's seconds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

MARK = "RP_BENCH_NO_AMX"  # set in the re-run process (and so in every peer it starts)
ISA = "AVX512_CORE_BF16"
FLAGS = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-mno-avx512fp16")
HERE = Path(__file__).resolve().parent


def enter(argv: list[str]) -> None:
    """Re-run `python -m bench.throughput argv[1:]` in a process with oneDNN capped and sitecustomize.py on the path
    (oneDNN reads its cap once, as torch loads it: too late in this process); in that process, make our kernels'
    builds AMX-less. Exits with a message on a CPU without AVX512-BF16."""
    from kernels.cpu_build import cpu_flags

    if "avx512_bf16" not in cpu_flags():
        raise SystemExit("--no-amx: this CPU has no AVX512-BF16, so there is no AMX-less bf16 path to time")
    if os.environ.get(MARK) != "1":
        path = [str(HERE), str(HERE.parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = os.environ | {MARK: "1", "ONEDNN_MAX_CPU_ISA": ISA, "PYTHONPATH": os.pathsep.join(path)}
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "bench.throughput", *argv[1:]], env)
    from kernels import cpu_build

    cpu_build.FLAGS = tuple(dict.fromkeys(cpu_build.FLAGS + FLAGS))
