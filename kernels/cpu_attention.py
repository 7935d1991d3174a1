"""Decode attention on CPU in C, reading the paged cache in place: kernels/cpu_attention.c, against
paged_attention_ref (kernels/paged_attention.py) for one query per sequence.

Why C: the torch path gathers every decode's blocks into a padded copy, then runs two batched matmuls whose rows are
the `rep` query heads of one kv head (3 for SmolLM2): a copy of the whole context per layer and per step, and GEMMs
too thin for oneDNN (attention was 43 % of the CPU time of bench/throughput.py's issue workload). Reading the blocks
where they lie, the rep heads sharing each row, made that workload 1.25-1.41x faster end to end (`--ab
native-attention`, alternated pairs; Intel Xeon VM, 2 cores; docs/decisions.md).

The shared object is built at run time for this CPU and one head_dim (kernels/cpu_build.py); a missing one is built
by a thread (about 0.5 s) while decodes take the torch path. Without a compiler, or when the build fails, decodes
keep the torch path and the log says why, once."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu_build import NativeKernel

CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, ctypes.c_int, _F, _F, _I64, _F, _P,
             ctypes.c_int]  # fmt: skip


def supported(head_dim: int) -> bool:
    return head_dim % 8 == 0 and 8 <= head_dim <= 512  # 8-lane vectors over D


class NativeDecode(NativeKernel):
    """The compiled kernel for one head_dim (the key), shared by every engine in the process (`get`)."""

    SOURCE = Path(__file__).with_name("cpu_attention.c")
    WHAT, FALLBACK = "CPU decode attention", "decodes take the torch path"

    def defines(self) -> tuple[str, ...]:
        return (f"-DHEAD_DIM={self.key}",)

    def label(self) -> str:
        return f"head_dim {self.key}"

    def setup(self, lib) -> None:
        lib.paged_decode.argtypes, lib.paged_decode.restype = _ARGTYPES, ctypes.c_int
        lib.init_tables()

    @classmethod
    def get(cls, head_dim: int, cache_dir: Path, wait: bool = False) -> NativeDecode | None:
        """The kernel for `head_dim` (None if that size is unsupported), loaded now when it is built, else built by
        a thread; `wait` blocks until it is ready or has failed."""
        return super().get(head_dim, cache_dir, wait) if supported(head_dim) else None

    def __call__(self, q, k_cache, v_cache, tables, ctx, scale, k_scale=None, v_scale=None, window=None, softcap=None,
                 sinks=None):  # fmt: skip
        """out [G, H, D] fp32 for q [G, H, D] (one token per sequence) over caches [KVH, NB, BS, D];
        tables [G, >= blocks] int32 and ctx [G] int32, both contiguous; sinks [H] (GPT-OSS) or None."""
        g, h, d = q.shape
        kvh, nb, bs, _ = k_cache.shape
        qs = (q.float() * scale).contiguous()
        out = torch.empty(g, h, d, dtype=torch.float32)
        sinks = None if sinks is None else sinks.float().contiguous()
        failed = self.lib.paged_decode(
            qs.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
            ctx.data_ptr(), out.data_ptr(), g, h, kvh, nb, bs, CACHE_DTYPES[k_cache.dtype],
            1.0 if k_scale is None else float(k_scale), 1.0 if v_scale is None else float(v_scale),
            window or 0, softcap or 0.0, None if sinks is None else sinks.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("CPU decode attention: out of memory for its scores")
        return out


def paged_decode_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None, window=None,
                     softcap=None, sinks=None, *, kernel: NativeDecode) -> torch.Tensor:  # fmt: skip
    """paged_attention_ref's result for a batch of decodes (query_start_loc = arange(G + 1)), in q's dtype."""
    tables = block_tables.to(torch.int32).contiguous()
    ctx = seq_lens.to(torch.int32).contiguous()
    return kernel(q, k_cache, v_cache, tables, ctx, scale, k_scale, v_scale, window, softcap, sinks).to(q.dtype)
