"""What the device decides: the model dtype for DTYPE=auto, and whether fp8 can run on this GPU. Plain functions
of the device's numbers (type, name, capability), so they are tested with made-up ones."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(setting: str, hf_cfg: dict, device_type: str) -> torch.dtype:
    """DTYPE, or with "auto": bf16, except fp16 checkpoints on CUDA (as vLLM). transformers >= 4.56 writes the
    checkpoint's dtype as "dtype", older ones as "torch_dtype"."""
    if setting != "auto":
        return _DTYPES.get(setting, torch.bfloat16)
    saved = hf_cfg.get("dtype") or hf_cfg.get("torch_dtype")
    return torch.float16 if device_type == "cuda" and saved == "float16" else torch.bfloat16


def check_fp8_support(cfg: EngineConfig, prequantized: bool, gpu: str, capability: tuple[int, int]) -> None:
    """fp8 (e4m3) weights and KV need compute capability 8.9 (Ada, Hopper, Blackwell): below it, triton 3.7
    cannot compile any kernel that touches fp8 (A100, A10, A40, A6000, RTX 30xx), so refuse before loading."""
    wanted = [
        name
        for name, on in (
            ("QUANTIZATION=fp8", cfg.quantization == "fp8"),
            ("an fp8 checkpoint", prequantized),
            (f"KV_CACHE_DTYPE={cfg.kv_cache_dtype}", cfg.kv_cache_dtype.startswith("fp8")),
        )
        if on
    ]
    if wanted and tuple(capability) < (8, 9):
        raise ConfigError(
            f"{' and '.join(wanted)} needs a GPU of compute capability 8.9 or newer (L4, L40S, RTX 40xx, "
            f"H100, H200, B200); this one is {gpu}, capability {capability[0]}.{capability[1]}. Use a "
            f"bf16 checkpoint, unset QUANTIZATION and set KV_CACHE_DTYPE=auto, or pick a newer GPU."
        )


DRIVER_FLOOR = 580  # torch's cu130 wheel needs the CUDA 13.0 driver, release 580 or newer


def gpu_line(
    name: str, capability: tuple[int, int], total_bytes: int, cuda: str | None, driver_cuda: int | None
) -> str:
    """The start-up log's GPU line. driver_cuda: the CUDA version the driver supports, as the driver API reports it
    (13000 = 13.0), or None when torch cannot say; an older driver than the build needs is named as the problem."""
    drv = f"{driver_cuda // 1000}.{driver_cuda % 1000 // 10}" if driver_cuda else "unknown"
    line = (
        f"GPU {name}, compute capability {capability[0]}.{capability[1]}, {total_bytes / 2**30:.1f} GiB; torch built "
        f"for CUDA {cuda}, the driver supports CUDA {drv} (CUDA {cuda} needs driver {DRIVER_FLOOR}+)"
    )
    if driver_cuda and cuda and driver_cuda < int(cuda.split(".")[0]) * 1000 + int(cuda.split(".")[1]) * 10:
        line += f"; THIS DRIVER IS TOO OLD for CUDA {cuda}: update it to {DRIVER_FLOOR}+ or pick another machine"
    return line


def cuda_driver_version() -> int | None:
    """cudaDriverGetVersion (13000 = 13.0) where this torch build exposes it."""
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        return int(get()) if get is not None else None
    except Exception:  # noqa: BLE001 - only a log line depends on it
        return None
