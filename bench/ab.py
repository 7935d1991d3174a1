"""bench/throughput.py's --ab: one engine with a switch on and off, alternated on the same prompts: what it buys.
Each switch turns one of our CPU paths off for the run that measures it (the default is on)."""

from __future__ import annotations

import statistics

from bench._common import Workload, timed


def _gemm_buckets(llm, on: bool) -> None:
    """Our CPU GEMM row buckets (engine/layers/dense.py) on, or every row count exact."""
    from engine.layers import dense

    dense.bucket = AB_DEFAULTS.setdefault("bucket", dense.bucket) if on else (lambda rows: rows)


def _native_attention(llm, on: bool) -> None:
    """Attention through the C kernel (kernels/cpu_attention.py), or the torch path (gathered decodes, SDPA)."""
    attn = llm.engine.runner.attn
    assert attn.native is None or attn.native.wait(), attn.native.error
    attn.native = AB_DEFAULTS.setdefault("native", attn.native) if on else None


def _native_prefill(llm, on: bool) -> None:
    """Prefill chunks through the C kernel with the decodes (engine/layers/attention.py NATIVE_PREFILL), or each
    through SDPA (the decodes stay on the kernel)."""
    from engine.layers import attention

    attn = llm.engine.runner.attn
    assert attn.native is not None and attn.native.wait(), "no C attention here"
    attention.NATIVE_PREFILL = on


def _thin_gemm(llm, on: bool) -> None:
    """Every bf16 linear through the thin GEMM (kernels/cpu_gemm.py), or (off) F.linear on the plain weight: no
    oneDNN copy is made where the kernel runs."""
    from kernels import cpu_gemm

    assert cpu_gemm.ThinGemm.loaded() is not None, "no thin GEMM here (a CPU without AVX512-BF16, or no compiler)"
    cpu_gemm.MAX_ROWS = AB_DEFAULTS.setdefault("max_rows", cpu_gemm.MAX_ROWS) if on else 0


def _cpu_ops(llm, on: bool) -> None:
    """bf16 add + RMSNorm and rotary through the C ops (kernels/cpu_ops.py), or their torch references."""
    from kernels import cpu_ops

    assert cpu_ops.CpuOps.current() is not None and cpu_ops.CpuOps.current().wait(), "no C ops here"
    cpu_ops.library = AB_DEFAULTS.setdefault("library", cpu_ops.library) if on else (lambda *tensors: None)


def _heap_keep(llm, on: bool) -> None:
    """malloc keeping freed memory for the next step (engine/host_memory.py keep_freed_memory), or glibc's starting
    thresholds (128 KiB) held fixed; each switch trims the heap first."""
    import ctypes

    from engine.host_memory import HEAP_KEEP, HEAP_LARGE

    libc = ctypes.CDLL(None)
    libc.mallopt(-1, HEAP_KEEP if on else 128 << 10)  # M_TRIM_THRESHOLD
    libc.mallopt(-3, HEAP_LARGE if on else 128 << 10)  # M_MMAP_THRESHOLD
    libc.malloc_trim(0)


def _native_write(llm, on: bool) -> None:
    """The step's new K/V rows written by the C attention's own call (engine/layers/attention.py NATIVE_WRITE), or by
    reshape_and_cache's torch ops before it, per layer."""
    from engine.layers import attention

    attn = llm.engine.runner.attn
    assert attn.native is not None and attn.native.wait(), "no C attention here"
    attention.NATIVE_WRITE = on


def _avx2_gemm(llm, on: bool) -> None:
    """bf16 linears through our AVX2 GEMM (kernels/cpu_gemm_avx2.c, engine/layers/dense.py AVX2: where oneDNN has no
    bf16 GEMM for this CPU), or MKL's fp32 GEMM on the weights widened per call (and torch's bf16 GEMM up to 16 rows),
    what dense() runs without the kernel."""
    from engine.layers import dense
    from kernels import cpu_gemm

    assert cpu_gemm.Avx2Gemm.loaded() is not None, "no AVX2 GEMM here (oneDNN has a bf16 GEMM, or no compiler)"
    dense.AVX2 = on


def _native_stack(llm, on: bool) -> None:
    """Every layer of a step in one C call (engine/layers/native_stack.py), or the layers' loop in Python over the
    same kernels (the same bits)."""
    from engine.layers import native_stack
    from kernels.cpu_layers import NativeLayers

    assert NativeLayers.current() is not None and NativeLayers.current().wait(), "no C layer loop here"
    native_stack.ENABLED = on


def _fused_silu(llm, on: bool) -> None:
    """gate_up and SiLU-and-mul in one call (kernels/cpu_gemm.c gemm_silu), in the native stack and the Python loop,
    or two (the same bits): engine/layers/dense.py FUSED_SILU."""
    from engine.layers import dense

    dense.FUSED_SILU = on


def _block_runs(llm, on: bool) -> None:
    """A request's next KV block after its last where free, else the lowest free one (engine/block_manager.py
    RUNS), or the most recently freed one."""
    from engine import block_manager

    block_manager.RUNS = on


AB_DEFAULTS: dict = {}  # what each switch found on, restored after
AB = {"gemm-buckets": _gemm_buckets, "native-attention": _native_attention, "native-prefill": _native_prefill,
      "thin-gemm": _thin_gemm, "cpu-ops": _cpu_ops, "heap-keep": _heap_keep, "avx2-gemm": _avx2_gemm,
      "native-write": _native_write, "native-stack": _native_stack, "fused-silu": _fused_silu,
      "block-runs": _block_runs}  # fmt: skip


def ab(llm, wl: Workload, device, generate, name: str | None, pairs: int = 4) -> None:
    """Our engine with switch `name` (AB; None: nothing) on against off, alternated (which goes first too) on the same
    engine and prompts, prefix caching off (a repeat would hit the first run's blocks): what the switch buys. Prints
    each pair and the median ratio of tok/s, on / off."""
    if name is None:
        return
    switch, eng, ratios = AB[name], llm.engine, []
    switch(llm, True)  # records the default
    cfg, eng.cfg = eng.cfg, eng.cfg.replace(enable_prefix_caching=False)
    try:
        for i in range(pairs):
            t = {}
            for on in (True, False) if i % 2 == 0 else (False, True):
                switch(llm, on)
                t[on] = timed(lambda: generate(llm, wl), device)
            ratios.append(t[False] / t[True])
            print(f"  {name}, pair {i + 1}: {t[True]:.2f} s on, {t[False]:.2f} s off; on / off "
                  f"{ratios[-1]:.3f}x tok/s", flush=True)  # fmt: skip
    finally:
        switch(llm, True)
        eng.cfg = cfg
    print(f"  {name}: median {statistics.median(ratios):.3f}x the tok/s with it off", flush=True)
