"""The one frozen engine config. Validated at construction; run-time facts (block counts) live elsewhere."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ConfigError
from engine.faults import parse_fault_injection
from engine.quant.scheme import ALIASES as QUANT_ALIASES
from engine.quant.scheme import METHODS as QUANT_METHODS
from engine.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


def default_cache_root() -> str:
    """A per-user cache dir. On Runpod, handler/settings.py passes BASE_PATH instead."""
    return str(Path.home() / ".cache" / "rp-llm-worker")


def writable_dir(path: str | Path) -> bool:
    """Whether this process could create files under `path` (creating it if missing), checked without
    writing anything: the nearest existing ancestor must be a directory we may write (a read-only mount
    says no, as does a non-root user's /runpod-volume that does not exist)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)


def default_hf_cache_dirs() -> tuple[str, ...]:
    return (str(Path.home() / ".cache" / "huggingface" / "hub"),)


@dataclass(frozen=True)
class EngineConfig:
    """Each field is also the worker's environment variable of its name upper-cased, typed and defaulted as here
    (handler/settings.py derives them; it renames a few to worker-vllm's names and keeps a few internal), so a new
    field needs a row in docs/configuration.md. A value that cannot work raises ConfigError naming the field."""

    model: str | None = None  # local dir, HF repo id found in an HF cache, or None for the default model
    revision: str = "main"
    tokenizer: str | None = None  # defaults to the model's folder
    dtype: str = "auto"  # auto: bfloat16 (fp32 and fp16 checkpoints included; CPU bf16 GEMMs are fastest)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped by the KV pool
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # most tokens one request takes per step (0 = the whole budget)
    kv_cache_memory: int | None = None  # KV pool bytes on CPU; None: automatic (engine/host_memory.py)
    gpu_memory_utilization: float = 0.90  # fraction of GPU memory for weights + KV on CUDA
    num_kv_blocks: int | None = None  # fixed pool size; overrides both budgets (tests, planner)
    cache_root: str = dataclasses.field(default_factory=default_cache_root)
    hf_cache_dirs: tuple[str, ...] = dataclasses.field(default_factory=default_hf_cache_dirs)
    # None; fp8: a 16-bit checkpoint's linears quantized per channel at load (W8A8); awq | gptq | compressed-tensors
    # (and vLLM's awq_marlin, gptq_marlin): the checkpoint's own method, checked against its quantization_config
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # auto: the model dtype | fp8 (e4m3, per-layer scales; half the bytes)
    kernel_backend: str = "auto"  # auto: Triton kernels on CUDA, torch references on CPU | torch | triton
    # CUDA graphs for decode steps (engine/cuda_graphs.py) are off until a GPU check shows them equal and faster
    enforce_eager: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's choice
    log_stats_interval: float = 5.0  # seconds between status lines while busy; 0 disables
    enable_prefix_caching: bool = True  # full KV blocks keyed by hash(parent, tokens, adapter); reused across requests
    # LoRA: adapters named per request, fetched from S3 (or a local dir) into a disk cache, MAX_LORAS device slots
    enable_lora: bool = False
    max_loras: int = 1  # adapters resident at once (device slots)
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()  # static (name, local path or s3:// URI)
    lora_s3_uri: str | None = None  # s3://bucket/prefix/: an unknown name resolves to <prefix><name>/
    lora_allowed_buckets: tuple[str, ...] = ()  # buckets a request may name in an explicit s3_uri
    s3_endpoint_url: str | None = None  # R2, MinIO, Backblaze or any S3-compatible store; None = AWS
    lora_cache_bytes: int = 10 << 30  # disk cache of downloaded adapters (LRU), under cache_root/lora-cache
    lora_load_timeout_s: float = 120.0  # a request whose adapter is not ready by then fails (only that request)
    # Tensor parallelism (engine/parallel/): ranks, each a process on its own GPU (gloo processes on CPU)
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 300.0  # a collective waiting longer than this fails the engine (a hung rank)
    # a step running longer fails every request and the worker asks to be replaced (a hung kernel or collective)
    step_timeout_s: float = 300.0
    fault_injection: str | None = None  # "KIND@STEP,...": faults made on purpose (engine/faults.py; tests, chaos)
    # Speculative decoding (engine/spec_decode/): n-gram prompt lookup or a draft model; a dict or its JSON is taken
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"EngineConfig.{name}={getattr(self, name)!r}: {why}", field=name)

        need(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        need(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "device",
            "must be auto, cpu or cuda[:N]",
        )
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        need(self.block_size in (8, 16, 32, 64, 128), "block_size", "must be 8, 16, 32, 64 or 128")
        need(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        need(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", "must be >= 0")
        need(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory", "must be > 0 bytes")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        need(self.quantization in (None, *QUANT_METHODS, *QUANT_ALIASES), "quantization",
             f"must be one of {', '.join((*QUANT_METHODS, *QUANT_ALIASES))}, or unset")  # fmt: skip
        need(self.kv_cache_dtype in ("auto", "fp8", "fp8_e4m3"), "kv_cache_dtype", "must be auto, fp8 or fp8_e4m3")
        need(self.kernel_backend in ("auto", "torch", "triton"), "kernel_backend", "must be auto, torch or triton")
        need(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")
        need(self.max_loras >= 1, "max_loras", "must be >= 1")
        need(self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        need(self.lora_cache_bytes > 0, "lora_cache_bytes", "must be > 0 bytes")
        need(self.lora_load_timeout_s > 0, "lora_load_timeout_s", "must be > 0 seconds")
        need(self.lora_s3_uri is None or self.lora_s3_uri.startswith("s3://"), "lora_s3_uri", "must start with s3://")
        need(
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            "must be an integer >= 1",
        )
        need(self.distributed_timeout_s > 0, "distributed_timeout_s", "must be > 0 seconds")
        need(self.step_timeout_s > 0, "step_timeout_s", "must be > 0 seconds")
        try:
            parse_fault_injection(self.fault_injection)
        except ValueError as e:
            need(False, "fault_injection", str(e))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        if isinstance(self.hf_cache_dirs, (list, str)):
            dirs = (self.hf_cache_dirs,) if isinstance(self.hf_cache_dirs, str) else tuple(self.hf_cache_dirs)
            object.__setattr__(self, "hf_cache_dirs", dirs)
        # accept lists and paths; store tuples of str (hashable, frozen)
        object.__setattr__(self, "lora_modules", tuple((str(n), str(p)) for n, p in self.lora_modules))
        object.__setattr__(self, "lora_allowed_buckets", tuple(self.lora_allowed_buckets))

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
