"""The KV pool: one preallocated tensor, sized by engine/memory.py's plan (on CPU, faulted in ahead of use by the
Prefaulter); fp8 KV scale calibration."""

from __future__ import annotations

import logging
import mmap
import threading
from dataclasses import dataclass

import torch

from engine.host_memory import madvise
from engine.layers.attention import softmax_with_sinks
from engine.memory import MemoryPlan
from engine.models.spec import ModelSpec
from kernels import FP8_MAX

log = logging.getLogger(__name__)


def allocate(
    spec: ModelSpec, plan: MemoryPlan, dtype: torch.dtype, device: torch.device, prefault: Prefaulter | None = None
) -> torch.Tensor:
    """The zeroed pool. On CPU its pages are faulted in by `prefault` as the block manager opens blocks (without
    one: all of them, in the background)."""
    # [layers, K/V, kv_heads, blocks, block_size, head_dim]: head-major, so a gather of blocks lands
    # as [kv_heads, seqs, ctx, head_dim] and feeds batched matmuls without a copy. Zeros: stale slots
    # are finite.
    shape = (spec.num_kv_layers, 2, spec.num_kv_heads, plan.num_blocks, plan.block_size, spec.head_dim)
    if device.type == "cpu":
        return (prefault or Prefaulter(plan.num_blocks)).zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


CHUNK_BYTES = 16 << 20  # a CPU pool's growth step: this much KV (every layer's, a draft model's too)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def growth_chunk(plan: MemoryPlan) -> int:
    """Blocks per growth step of a CPU pool's open region: CHUNK_BYTES of KV, at least one block, at most the pool."""
    return max(1, min(plan.num_blocks, CHUNK_BYTES // (plan.kv_bytes_per_token * plan.block_size)))


@dataclass
class _Pool:
    buf: mmap.mmap
    addr: int
    segments: int  # layers x 2 x kv_heads: each holds every block's slots of one (layer, K/V, head)
    block_bytes: int  # one block within a segment
    num_blocks: int
    done: int = 0  # blocks [0, done) populated, or being populated


class Prefaulter:
    """The CPU pools of one engine's block ids (the target's, and a draft model's), faulted in ahead of use by one
    background thread.

    - A pool is an anonymous private mapping: zero pages by definition, so a pool costs nothing at start (an explicit
      zero-fill took 0.4-2 s of the cold start) and memory only where its pages are touched. Private, not Python's
      default MAP_SHARED: shared anonymous memory is shmem, whose first touch took twice the system time here (0.9
      vs 0.45 s per GiB), and which transparent huge pages skip where shmem_enabled is never (the usual setting).
    - The block manager hands out blocks from an open region that grows a `chunk` at a time with the load
      (engine/block_manager.py). `open(n)` asks the thread to have blocks [0, n + chunk) populated, a chunk ahead
      of the region [0, n), so no step meets a first touch and the start never waits for one. At first: the first
      region and a chunk ahead. chunk None: the whole pool at once.
    - MADV_POPULATE_WRITE (Linux 5.14+; ctypes releases the GIL). In the head-major layout a block range is
      layers x 2 x kv_heads separate segments, each populated over its own bytes (rounded out to whole pages).
    - No MADV_HUGEPAGE: on the MAP_SHARED pool it advised it had no effect; on a private one each segment would grow
      2 MiB at a time (360 MiB a step for SmolLM2's 180 segments), and populating took 3x the system time here.
    - The thread runs only while something is left to populate: a dropped engine's pools are freed."""

    def __init__(self, num_blocks: int, chunk: int | None = None):
        self.num_blocks = num_blocks
        self.chunk = chunk
        self.target = num_blocks if chunk is None else min(2 * chunk, num_blocks)  # blocks [0, target) asked for
        self._pools: list[_Pool] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._unavailable = False  # no madvise, or a kernel without MADV_POPULATE_WRITE: pages fault on first use

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero pool [layers, 2, kv_heads, blocks, block_size, head_dim] of `num_blocks` blocks, populated as far
        as asked."""
        assert shape[3] == self.num_blocks, (shape, self.num_blocks)
        nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(buf, dtype=torch.uint8)  # shares the mapping; the tensor keeps `buf` alive
        segments = shape[0] * shape[1] * shape[2]
        with self._lock:
            self._pools.append(_Pool(buf, raw.data_ptr(), segments, nbytes // segments // shape[3], shape[3]))
            self._start()
        return raw.view(dtype).view(shape)

    def open(self, num_open: int) -> None:
        """The block manager's region is now blocks [0, num_open): populate up to a chunk past it."""
        if self.chunk is None:
            return
        with self._lock:
            if (want := min(num_open + self.chunk, self.num_blocks)) > self.target:
                self.target = want
                self._start()

    def wait(self) -> None:
        """Until the thread has populated what was asked (tests, and measurements of memory)."""
        while (th := self._thread) is not None:
            th.join()

    def _start(self) -> None:  # under the lock
        if self._thread is None and any(p.done < self.target for p in self._pools):
            self._thread = threading.Thread(target=self._run, name="kv-pool-prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                work = [(p, p.done, self.target) for p in self._pools if p.done < self.target]
                if not work:
                    self._thread = None
                    return
                for p, _, hi in work:  # claimed: a later open() adds only what lies past hi
                    p.done = hi
            for p, lo, hi in work:
                self._populate(p, lo, hi)

    def _populate(self, p: _Pool, lo: int, hi: int) -> None:
        """Fault in blocks [lo, hi) of every segment of pool `p`."""
        if self._unavailable:
            return
        seg = p.block_bytes * p.num_blocks
        if lo == 0 and hi == p.num_blocks:  # whole segments are one contiguous range
            spans = [(p.addr, p.segments * seg)]
        else:
            spans = [(p.addr + s * seg + lo * p.block_bytes, (hi - lo) * p.block_bytes) for s in range(p.segments)]
        try:
            if (err := madvise(spans, _MADV_POPULATE_WRITE)) != 0:
                raise OSError(f"errno {err}")  # EINVAL: a kernel before 5.14
        except OSError as e:  # not Linux/glibc, or an old kernel
            self._unavailable = True
            _warn_prefault_once(str(e))


_prefault_warned = False


def _warn_prefault_once(why: str) -> None:
    """The reason is the same for every pool of the process (the draft's too), so it is said once."""
    global _prefault_warned
    if not _prefault_warned:
        _prefault_warned = True
        log.warning("KV pool pre-fault unavailable (%s): pages fault in on first use, inside steps", why)


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

    def forward(self, q, k, v, k_cache, v_cache, meta, layer: int = 0, sinks=None):
        self.k_amax[layer] = max(self.k_amax[layer].item(), k.abs().max().float().item())
        self.v_amax[layer] = max(self.v_amax[layer].item(), v.abs().max().float().item())
        self.over_448 += int((k.abs() > FP8_MAX).sum()) + int((v.abs() > FP8_MAX).sum())
        self.count += k.numel() + v.numel()
        if sinks is not None:  # GPT-OSS: SDPA has no sinks
            rep = q.shape[1] // k.shape[1]
            s = torch.einsum("thd,shd->hts", q.float(), k.float().repeat_interleave(rep, 1)) * self.scale
            s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
            p = softmax_with_sinks(s, sinks.view(-1, 1, 1))  # [H, T, T]
            return torch.einsum("hts,shd->thd", p, v.float().repeat_interleave(rep, 1)).to(q.dtype)
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
    # by layer index: a hybrid's linear layers have none (and no KV to scale)
    k = torch.tensor([ck[i]["k"] if i in ck else 1.0 for i in range(n)], device=device)
    v = torch.tensor([ck[i]["v"] if i in ck else 1.0 for i in range(n)], device=device)
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
    seen = [i for i in range(spec.num_layers) if not spec.is_linear(i)]  # a hybrid's linear layers have no KV
    log.info(
        "fp8 KV scales calibrated on %d tokens: k %.3g..%.3g, v %.3g..%.3g; clipped 0 %% of calibration "
        "values (a scale of 1.0 would clip %.4f %%)",
        len(token_ids),
        k_scales[seen].min(),
        k_scales[seen].max(),
        v_scales[seen].min(),
        v_scales[seen].max(),
        100 * blind,
    )
    return k_scales.to(device), v_scales.to(device)
