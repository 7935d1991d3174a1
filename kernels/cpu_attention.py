"""Paged attention on CPU in C for a whole step (prefill chunks and decodes in one call), reading the paged cache in
place: kernels/cpu_attention.c, against paged_attention_ref (kernels/paged_attention.py).

Why C: the torch path gathers every decode's blocks into a padded copy, then runs two batched matmuls whose rows are
the `rep` query heads of one kv head (3 for SmolLM2): a copy of the whole context per layer and per step, and GEMMs
too thin for oneDNN (attention was 43 % of the CPU time of bench/throughput.py's issue workload). Reading the blocks
where they lie, the rep heads sharing each row, made that workload 1.25-1.41x faster end to end (`--ab
native-attention`, alternated pairs; Intel Xeon VM, 2 cores; docs/decisions.md). Prefill chunks joined it later:
SDPA's bf16 flash kernel ran at 47 GFLOP/s on the AVX2 EPYC where this one runs at 75-80, and a token's output no
longer depends on whether it came in a prefill or a decode (docs/decisions.md, "Prefill chunks through the C
attention too").

The shared object is built at run time for this CPU and one head_dim (kernels/cpu_build.py); a missing one is built
by a thread (about 0.5 s) while attention takes the torch path. Without a compiler, or when the build fails,
attention keeps the torch path and the log says why, once."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu_build import NativeKernel

CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}
Q_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # q, the new K / V rows and out
_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_ARGTYPES = [_P, _I64, _INT, _F, _P, _P, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64,
             _I64, _INT, _P, _P, _I64, _F, _P, _INT]  # fmt: skip


def supported(head_dim: int) -> bool:
    return head_dim % 8 == 0 and 8 <= head_dim <= 512  # 8-lane vectors over D


class NativeAttention(NativeKernel):
    """The compiled kernel for one head_dim (the key), shared by every engine in the process (`get`)."""

    SOURCE = Path(__file__).with_name("cpu_attention.c")
    WHAT, FALLBACK = "CPU attention", "attention takes the torch path"

    def __init__(self, key, cache_dir: Path):
        super().__init__(key, cache_dir)
        self._ones: dict[int, torch.Tensor] = {}  # kvh -> the scales of a cache that has none
        self.rounds_weights = False  # set by setup() from the build

    def defines(self) -> tuple[str, ...]:
        return (f"-DHEAD_DIM={self.key}",)

    def label(self) -> str:
        return f"head_dim {self.key}"

    def setup(self, lib) -> None:
        lib.paged_attention.argtypes, lib.paged_attention.restype = _ARGTYPES, ctypes.c_int
        lib.init_tables()
        # the AVX512-BF16 build rounds a bf16 q's softmax weights to bf16 for the weighted sum, as flash attention
        # does for its PV GEMM (a source before it: --against an older revision)
        self.rounds_weights = bool(lib.rounds_weights()) if hasattr(lib, "rounds_weights") else False

    @classmethod
    def get(cls, head_dim: int, cache_dir: Path, wait: bool = False) -> NativeAttention | None:
        """The kernel for `head_dim` (None if that size is unsupported), loaded now when it is built, else built by
        a thread; `wait` blocks until it is ready or has failed."""
        return super().get(head_dim, cache_dir, wait) if supported(head_dim) else None

    def __call__(self, q, k_cache, v_cache, tables, ctx, qsl, scale, k_scale=None, v_scale=None, window=None,
                 softcap=None, sinks=None, k=None, v=None, slots=None):  # fmt: skip
        """out [T, H, D] in q's dtype for q [T, H, D] (sequence s's tokens: rows qsl[s] .. qsl[s + 1], the last ones
        of its context) over caches [KVH, NB, BS, D]; tables [S, >= blocks], ctx [S] and qsl [S + 1] int32,
        contiguous; k_scale, v_scale: an fp8 cache's scale (one, or one per kv head), else None; sinks [H]
        (GPT-OSS) or None. k, v [T', KVH, D] in the cache's dtype and slots [T'] int64: the step's new rows, which
        the kernel writes into the caches before it reads them (None: the caller wrote them)."""
        t, h, d = q.shape
        kvh, nb, bs, _ = k_cache.shape
        if not all(x.is_cpu for x in (q, k_cache, v_cache, tables, ctx, qsl)):  # C reads host memory only
            named = zip("q k_cache v_cache tables ctx qsl".split(), (q, k_cache, v_cache, tables, ctx, qsl))
            off = [f"{n} on {x.device}" for n, x in named if not x.is_cpu]
            raise ValueError(f"CPU attention takes host tensors: {', '.join(off)}")
        if q.dtype not in Q_DTYPES:
            q = q.float()
        if q.stride(2) != 1 or q.stride(1) != d:  # tokens may be apart (a view of the fused qkv), heads not
            q = q.contiguous()
        if k is not None:
            if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or k_cache.dtype not in Q_DTYPES:
                raise ValueError(f"CPU attention writes new rows of the cache's dtype ({k_cache.dtype}), not fp8 "
                                 f"caches: k {k.dtype}, v {v.dtype}")  # fmt: skip
            if slots.dtype != torch.int64 or not slots.is_cpu or k.shape != v.shape or k.shape != (len(slots), kvh, d):
                raise ValueError(f"CPU attention: new rows k {tuple(k.shape)}, v {tuple(v.shape)}, slots {slots.dtype} "
                                 f"{tuple(slots.shape)} for caches of {kvh} kv heads of {d}")  # fmt: skip
            if not (k_cache.is_contiguous() and v_cache.is_contiguous()):  # C writes rows at computed offsets
                raise ValueError("CPU attention writes new rows into contiguous caches only")
            k, v = (x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous() for x in (k, v))
            slots = slots.contiguous()
        ks, vs = (self._scale(x, kvh) for x in (k_scale, v_scale))
        out = torch.empty(t, h, d, dtype=q.dtype)
        sinks = None if sinks is None else sinks.float().contiguous()
        failed = self.lib.paged_attention(
            q.data_ptr(), q.stride(0), Q_DTYPES[q.dtype], scale, None if k is None else k.data_ptr(),
            None if v is None else v.data_ptr(), 0 if k is None else k.stride(0), 0 if v is None else v.stride(0),
            None if slots is None else slots.data_ptr(), 0 if k is None else k.shape[0], k_cache.data_ptr(),
            v_cache.data_ptr(), tables.data_ptr(), tables.shape[1], ctx.data_ptr(), qsl.data_ptr(), ctx.shape[0],
            out.data_ptr(), h, kvh, nb, bs, CACHE_DTYPES[k_cache.dtype], ks.data_ptr(), vs.data_ptr(), window or 0,
            softcap or 0.0, None if sinks is None else sinks.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed == 2:
            raise ValueError(f"CPU attention: a slot past the cache's {nb * bs} rows")
        if failed:
            raise MemoryError("CPU attention: out of memory for its scores")
        return out

    def _scale(self, x, kvh: int) -> torch.Tensor:
        """[KVH] fp32: each kv head's scale of an fp8 cache (one for all, or one each), ones (kept) for None."""
        if x is None:
            if (ones := self._ones.get(kvh)) is None:
                ones = self._ones[kvh] = torch.ones(kvh)
            return ones
        return torch.as_tensor(x, dtype=torch.float32).reshape(-1).cpu().expand(kvh).contiguous()


def paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale=None,
                        v_scale=None, window=None, softcap=None, sinks=None, *, kernel: NativeAttention):  # fmt: skip
    """paged_attention_ref's result (prefill chunks and decodes together), in q's dtype."""
    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    out = kernel(q, k_cache, v_cache, i32(block_tables), i32(seq_lens), i32(query_start_loc), scale, k_scale, v_scale,
                 window, softcap, sinks)  # fmt: skip
    return out.to(q.dtype)
