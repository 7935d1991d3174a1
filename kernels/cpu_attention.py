"""Decode attention on CPU in C, reading the paged cache in place: kernels/cpu_attention.c, against
paged_attention_ref (kernels/paged_attention.py) for one query per sequence.

Why C: the torch path gathers every decode's blocks into a padded copy, then runs two batched matmuls whose rows are
the `rep` query heads of one kv head (3 for SmolLM2): a copy of the whole context per layer and per step, and GEMMs
too thin for oneDNN (attention was 43 % of the CPU time of bench/throughput.py's issue workload). Reading the blocks
where they lie, the rep heads sharing each row, made that workload 1.25-1.41x faster end to end (`--ab
native-attention`, alternated pairs; Intel Xeon VM, 2 cores; docs/decisions.md).

The shared object is built at run time with the system's C compiler (gcc or clang: `cc`, as Triton needs), for this
CPU (-march=native) and one head_dim, into `<cache>/cpu-kernels/` under a name that hashes the source, the flags,
the compiler and the CPU's model and flags: a network volume shared by unlike machines keeps one build per kind.
A cached build loads in about a millisecond; a missing one is built by a thread (about 0.5 s) while decodes take the
torch path. Without a compiler, or when the build fails, decodes keep the torch path and the log says why, once."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("engine")

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, ctypes.c_int, _F, _F, _I64, _F, _P,
             ctypes.c_int]  # fmt: skip


def supported(head_dim: int) -> bool:
    return head_dim % 8 == 0 and 8 <= head_dim <= 512  # 8-lane vectors over D


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and flags (Linux), else the platform's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() + platform.machine()


def library_path(cache_dir: Path, head_dim: int, cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = "\0".join([SOURCE.read_text(), " ".join(FLAGS), str(head_dim), version, _cpu_identity()])
    return Path(cache_dir) / f"cpu_attention-d{head_dim}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build(cache_dir: Path, head_dim: int, on_compile=lambda path: None) -> Path:
    """The shared object for `head_dim` in `cache_dir`, compiled unless it is there (then `on_compile(path)` is
    called first). Raises RuntimeError saying why it cannot be had (no compiler, a failed compile: the compiler's
    message)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    path = library_path(cache_dir, head_dim, cc)
    if path.exists():
        return path
    on_compile(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".so.tmp", dir=path.parent)
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, f"-DHEAD_DIM={head_dim}", "-o", tmp, str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-600:]}")
        os.replace(tmp, path)  # atomic: workers sharing the volume never load half a file
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))  # its libgomp.so.1 is the one torch loaded: one OpenMP pool
    lib.paged_decode.argtypes, lib.paged_decode.restype = _ARGTYPES, ctypes.c_int
    lib.init_tables()
    return lib


class NativeDecode:
    """The compiled kernel for one head_dim, shared by every engine in the process (`get`). `lib` is None until it
    is loaded, and stays None when it cannot be (`error` says why)."""

    _all: dict[int, NativeDecode] = {}
    _lock = threading.Lock()

    def __init__(self, head_dim: int, cache_dir: Path):
        self.head_dim, self.cache_dir = head_dim, Path(cache_dir)
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self._done = threading.Event()

    @classmethod
    def get(cls, head_dim: int, cache_dir: Path, wait: bool = False) -> NativeDecode | None:
        """The kernel for `head_dim` (None if that size is unsupported), loaded now when it is built, else built by
        a thread; `wait` blocks until it is ready or has failed."""
        if not supported(head_dim):
            return None
        with cls._lock:
            k = cls._all.get(head_dim)
            if k is None:
                k = cls._all[head_dim] = cls(head_dim, cache_dir)
                threading.Thread(target=k._make, name="cpu-attention-build", daemon=True).start()
        if wait:
            k.wait()
        return k

    def wait(self) -> bool:
        """Block until the build has ended; True when the kernel is loaded."""
        self._done.wait()
        return self.lib is not None

    def _make(self) -> None:
        t0 = time.perf_counter()
        try:
            built = []
            self.lib = load(build(self.cache_dir, self.head_dim, on_compile=built.append))
            how = f"built in {time.perf_counter() - t0:.1f}s" if built else "loaded"
            log.info("CPU decode attention: native kernel (head_dim %d) %s", self.head_dim, how)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            self.error = str(e)
            log.warning("CPU decode attention: native kernel unavailable, decodes take the torch path: %s", e)
        finally:
            self._done.set()

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
