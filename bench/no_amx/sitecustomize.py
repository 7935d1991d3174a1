"""Loaded by every Python that `python -m bench.throughput --no-amx` starts (bench/no_amx on PYTHONPATH): vLLM's CPU
attention takes its AMX kernels where torch says the CPU has AMX tiles; in that run torch says it has none."""

import os

if os.environ.get("RP_BENCH_NO_AMX") == "1":
    try:
        import torch
    except ImportError:  # a peer's venv before torch is in it
        torch = None
    if torch is not None:
        torch.cpu._is_amx_tile_supported = lambda: False
        torch._C._cpu._is_amx_tile_supported = lambda: False
