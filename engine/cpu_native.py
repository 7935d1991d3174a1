"""What a CPU engine sets up for its steps besides the model: the C kernels (kernels/cpu_build.py) started by
threads, and malloc told to keep freed memory for the next step (engine/host_memory.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.host_memory import keep_freed_memory
from engine.layers import dense
from kernels.cpu_gemm import Avx2Gemm, ThinGemm
from kernels.cpu_ops import CpuOps


def native_dir(cfg: EngineConfig, device: torch.device) -> Path | None:
    """Where CPU kernels in C are built and kept (kernels/cpu_build.py): beside the other caches, on CPU only."""
    return Path(cfg.cache_root) / "cpu-kernels" if device.type == "cpu" else None


def start_cpu(cfg: EngineConfig, device: torch.device, dtype: torch.dtype, wait: bool = False) -> None:
    """On CPU: malloc keeps a step's freed temporaries; for bf16, the AMX thin GEMM (its copies are packed after
    ready), or where oneDNN has no bf16 GEMM the AVX2 GEMM, and the C add + RMSNorm, each built or loaded by a thread.
    `wait` (build_rank; LLMEngine starts it before the weights load): for the AVX2 GEMM, which every bf16 linear then
    runs, from the first step on (so a row's result never depends on which GEMM its step got). The decode
    attention's kernel is started by build_attention, per head_dim."""
    if device.type != "cpu":
        return
    keep_freed_memory()
    if dtype == torch.bfloat16:
        if ThinGemm.get(native_dir(cfg, device)) is None and not dense.onednn_bf16():
            Avx2Gemm.get(native_dir(cfg, device), wait=wait)
        CpuOps.get(native_dir(cfg, device))
