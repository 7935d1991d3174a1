"""What a CPU engine sets up for its steps besides the model: the C kernels (kernels/cpu_build.py) started by
threads, and malloc told to keep freed memory for the next step (engine/host_memory.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.host_memory import keep_freed_memory
from engine.layers import dense
from kernels.cpu_attention import NativeAttention
from kernels.cpu_gemm import Avx2Gemm, ThinGemm
from kernels.cpu_layers import NativeLayers
from kernels.cpu_ops import CpuOps


def native_dir(cfg: EngineConfig, device: torch.device) -> Path | None:
    """Where CPU kernels in C are built and kept (kernels/cpu_build.py): beside the other caches, on CPU only."""
    return Path(cfg.cache_root) / "cpu-kernels" if device.type == "cpu" else None


def start_cpu(cfg: EngineConfig, facts, wait: bool = False) -> None:
    """On CPU (facts: engine/startup.py's ModelFacts): malloc keeps a step's freed temporaries; the C attention for
    the model's head_dim (unless the Triton kernels run attention); for bf16, the thin GEMM where the CPU has
    AVX512-BF16 (its copies are packed after ready), or where oneDNN has no bf16 GEMM the AVX2 GEMM, and the C add +
    RMSNorm, each built or loaded by a thread. `wait` (build_runner; LLMEngine starts them before the weights load):
    for the attention, the AVX2 GEMM and the thin GEMM, which then run from the first step on (so a token's result
    never depends on which path its step got: a server's first requests as its later ones)."""
    device, dtype = facts.device, facts.dtype
    if device.type != "cpu":
        return
    keep_freed_memory()
    if facts.kernel_backend != "triton":  # build_attention takes this one
        NativeAttention.get(facts.rank_spec.head_dim, native_dir(cfg, device), wait=wait)
    if dtype == torch.bfloat16:  # waited for: it runs every bf16 linear from the first step
        if ThinGemm.get(native_dir(cfg, device), wait=wait) is None and not dense.onednn_bf16():
            Avx2Gemm.get(native_dir(cfg, device), wait=wait)
        CpuOps.get(native_dir(cfg, device))
        NativeLayers.get(native_dir(cfg, device))  # engine/layers/native_stack.py runs it once loaded
