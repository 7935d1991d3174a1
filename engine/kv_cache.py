"""The KV pool: one preallocated tensor, sized by engine/memory.py's plan; fp8 KV scale calibration."""

from __future__ import annotations

import logging
import mmap
import threading

import torch

from engine.memory import MemoryPlan
from engine.models.spec import ModelSpec
from kernels import FP8_MAX

log = logging.getLogger(__name__)


def allocate(spec: ModelSpec, plan: MemoryPlan, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # [layers, K/V, kv_heads, blocks, block_size, head_dim]: head-major, so a gather of blocks lands
    # as [kv_heads, seqs, ctx, head_dim] and feeds batched matmuls without a copy. Zeros: stale slots
    # are finite.
    shape = (spec.num_layers, 2, spec.num_kv_heads, plan.num_blocks, plan.block_size, spec.head_dim)
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
    except (OSError, AttributeError) as e:  # not Linux/glibc: ordinary pages, same results
        _warn_prefault_once(f"no madvise here ({e})")
    else:
        populate_in_background(libc, buf, raw.data_ptr() + offset, nbytes)
    return raw[offset : offset + nbytes].view(dtype).view(shape)


_prefault_warned = False


def _warn_prefault_once(why: str) -> None:
    """The reason is the same for every pool of the process (the draft's too), so it is said once."""
    global _prefault_warned
    if not _prefault_warned:
        _prefault_warned = True
        log.warning("KV pool pre-fault unavailable (%s): pages fault in on first use, inside steps", why)


def populate_in_background(libc, buf, addr: int, nbytes: int) -> threading.Thread:
    """Fault the pool's pages in on a thread (MADV_POPULATE_WRITE, Linux 5.14+; ctypes releases the GIL), so the
    start does not wait for it and no step stalls on a first touch later. With 2 MiB pages and the head-major
    layout, the first use of a block range faults in layers x 2 x kv_heads pages at once (SmolLM2: 180 pages,
    360 MiB, in the middle of a step), and the worker's RSS crept up for minutes as the scheduler reached new
    block ranges (bench/soak.py)."""

    def run(_buf) -> None:  # holds the mmap until done; Thread drops its args when run returns
        import ctypes

        if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), 23) != 0:  # MADV_POPULATE_WRITE
            _warn_prefault_once(f"errno {ctypes.get_errno()}")  # a kernel before 5.14

    th = threading.Thread(target=run, args=(buf,), name="kv-pool-prefault", daemon=True)
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
def kv_scales(model, calibration_ids: list[int] | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer fp8 K and V scales: the checkpoint's (calibration_ids None), else calibrated on those tokens (under
    tensor parallelism every rank calibrates its own heads in the same forward pass)."""
    if calibration_ids is not None:
        return calibrate_kv_scales(model, calibration_ids, device)
    log.info("fp8 KV scales from the checkpoint")
    ck, n = model.checkpoint_kv_scales, model.spec.num_layers
    k = torch.tensor([ck[i]["k"] for i in range(n)], device=device)
    v = torch.tensor([ck[i]["v"] for i in range(n)], device=device)
    return k, v


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
