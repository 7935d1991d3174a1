"""The KV pool: one preallocated tensor, sized from a memory budget."""

from __future__ import annotations

import logging
import mmap
import threading
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.models.llama import ModelSpec
from kernels import FP8_MAX

log = logging.getLogger(__name__)


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes: the seed's formula."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * torch.tensor([], dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrent_seqs(self) -> float:
        return self.num_tokens / self.max_model_len

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} = {self.num_tokens} tokens, "
            f"{self.bytes_per_token} B/token ({self.num_tokens * self.bytes_per_token / 2**20:.0f} MiB), "
            f"{self.max_concurrent_seqs:.1f} concurrent sequences at max_model_len={self.max_model_len}"
        )


def plan_capacity(
    cfg: EngineConfig, spec: ModelSpec, kv_dtype: torch.dtype, device: torch.device, weight_bytes: int
) -> KVCapacity:
    per_token = kv_bytes_per_token(spec, kv_dtype)
    per_block = per_token * cfg.block_size
    if cfg.num_kv_blocks is not None:
        num_blocks = cfg.num_kv_blocks
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - weight_bytes // 8  # activations
        num_blocks = max(budget // per_block, 0)
    else:
        num_blocks = cfg.kv_cache_memory // per_block
    pool_tokens = num_blocks * cfg.block_size
    if cfg.max_model_len is not None:
        max_len = cfg.max_model_len
        if max_len > spec.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings={spec.max_position_embeddings}"
            )
        if max_len > pool_tokens:
            raise ConfigError(
                f"max_model_len={max_len} does not fit the KV pool ({pool_tokens} tokens in "
                f"{num_blocks} blocks); raise the KV memory budget or lower max_model_len"
            )
    else:
        max_len = min(spec.max_position_embeddings, pool_tokens)
    if max_len < 1:
        raise ConfigError("the KV memory budget holds no block; raise kv_cache_memory / gpu_memory_utilization")
    return KVCapacity(num_blocks, cfg.block_size, per_token, max_len)


def allocate(spec: ModelSpec, cap: KVCapacity, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # [layers, K/V, kv_heads, blocks, block_size, head_dim]: head-major, so a gather of blocks lands
    # as [kv_heads, seqs, ctx, head_dim] and feeds batched matmuls without a copy. Zeros: stale slots
    # are finite.
    shape = (spec.num_layers, 2, spec.num_kv_heads, cap.num_blocks, cap.block_size, spec.head_dim)
    if device.type == "cpu":
        return _cpu_hugepage_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


_HUGE = 2 << 20


def _cpu_hugepage_zeros(shape, dtype) -> torch.Tensor:
    """Zeros from an anonymous mmap, backed by 2 MiB pages where the kernel allows it (THP in madvise mode is
    common).

    - Anonymous pages are zero by definition, so a GiB pool costs nothing at start (an explicit zero-fill took
      0.4-2 s of the cold start); a background thread then faults them in (populate_in_background).
    - Decode gathers touch scattered blocks across the pool; with 4 KiB pages they miss the TLB constantly.
      Measured here: a decode step's 180 block gathers take 32 % less time with 2 MiB pages."""
    nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes + _HUGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # shares the mapping; the tensor keeps `buf` alive
    offset = (-raw.data_ptr()) % _HUGE
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(raw.data_ptr() + offset), ctypes.c_size_t(nbytes), 14)  # MADV_HUGEPAGE
    except (OSError, AttributeError):
        pass  # not Linux/glibc: ordinary pages, same results
    else:
        populate_in_background(libc, buf, raw.data_ptr() + offset, nbytes)
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def populate_in_background(libc, buf, addr: int, nbytes: int) -> threading.Thread:
    """Fault the pool's pages in on a thread (MADV_POPULATE_WRITE, Linux 5.14+; ctypes releases the GIL), so the
    start does not wait for it and no step stalls on a first touch later. With 2 MiB pages and the head-major
    layout, the first use of a block range faults in layers x 2 x kv_heads pages at once (SmolLM2: 180 pages,
    360 MiB, in the middle of a step), and the worker's RSS crept up for minutes as the scheduler reached new
    block ranges (bench/soak.py). `buf` (the mmap) is held until the thread is done."""

    def run() -> None:
        import ctypes

        if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), 23) != 0:  # MADV_POPULATE_WRITE
            log.debug("KV pool pre-fault unavailable (errno %d): pages fault in on first use", ctypes.get_errno())
        del holder[:]

    holder = [buf]
    th = threading.Thread(target=run, name="kv-pool-prefault", daemon=True)
    th.start()
    return th


# A short built-in text for fp8 KV calibration: prose, code and numbers, so K/V ranges resemble real use.
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; Neil Armstrong "
    "and Buzz Aldrin walked on the surface for about two and a half hours. def fibonacci(n):\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "Photosynthesis converts light energy into chemical energy: 6 CO2 + 6 H2O -> C6H12O6 + 6 O2. "
    "User: Can you summarize the plot of Hamlet in two sentences?\nAssistant: Prince Hamlet seeks revenge "
    "on his uncle Claudius, who murdered Hamlet's father to seize the throne. His hesitation and feigned "
    'madness lead to a chain of deaths, including his own. 3.14159 2.71828 1.41421 | {"key": [1, 2, 3]}'
)


class CalibrationAttention:
    """Stands in for the attention backend during one cache-less forward over the calibration text:
    plain causal attention over the sequence itself, recording max |k| and max |v| per layer."""

    def __init__(self, num_layers: int, scale: float):
        self.scale = scale
        self.k_amax = torch.zeros(num_layers)
        self.v_amax = torch.zeros(num_layers)
        self.over_448 = 0  # values a blind scale of 1.0 would clip
        self.count = 0

    def forward(self, q, k, v, k_cache, v_cache, meta, layer: int = 0):
        self.k_amax[layer] = max(self.k_amax[layer].item(), k.abs().max().float().item())
        self.v_amax[layer] = max(self.v_amax[layer].item(), v.abs().max().float().item())
        self.over_448 += int((k.abs() > FP8_MAX).sum()) + int((v.abs() > FP8_MAX).sum())
        self.count += k.numel() + v.numel()
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=self.scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return o[0].transpose(0, 1)


@torch.inference_mode()
def calibrate_kv_scales(model, token_ids: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer fp8 scales = max |x| / 448 over one forward of the calibration text, so nothing in it
    saturates. Logs the scales and what a blind 1.0 would have clipped."""
    spec = model.spec
    cal = CalibrationAttention(spec.num_layers, spec.head_dim**-0.5)
    ids = torch.tensor(token_ids, device=device)
    model(ids, torch.arange(len(token_ids), device=device), torch.empty(spec.num_layers, 2, 0), cal, None)
    k_scales = (cal.k_amax / FP8_MAX).clamp(min=1e-6)
    v_scales = (cal.v_amax / FP8_MAX).clamp(min=1e-6)
    blind = cal.over_448 / max(cal.count, 1)
    log.info(
        "fp8 KV scales calibrated on %d tokens: k %.3g..%.3g, v %.3g..%.3g; clipped 0 %% of calibration "
        "values (a scale of 1.0 would clip %.4f %%)",
        len(token_ids),
        k_scales.min(),
        k_scales.max(),
        v_scales.min(),
        v_scales.max(),
        100 * blind,
    )
    return k_scales.to(device), v_scales.to(device)
