"""OpenMP's thread pools on CPU: one thread, the engine's step loop, should own the only one.

libgomp (the OpenMP runtime torch and kernels/cpu_*.c share) gives every thread that opens a parallel region a pool
of its own, kept until that thread exits. It counts the threads of all pools, and once they outnumber the CPUs
every worker spins only 1,000 rounds (not 300,000) before it sleeps on a futex, so each of the hundreds of parallel
regions of a step pays for waking a sleeping thread. A worker whose engine was built on one thread (the main
thread: weight conversions, the kernel warm-up) and steps on another (AsyncEngine's) had two pools on 2 CPUs, and
streamed one job at 42 tok/s where LLM.generate decodes at 73 (docs/decisions.md, "One OpenMP pool"). Ending the
other threads' pools when their torch work is done (the builder's, a LoRA loader's) leaves the step loop's alone:
it spins as it should."""

from __future__ import annotations

import ctypes

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t; libgomp frees the calling thread's pool for either kind


def _libgomps() -> list[ctypes.CDLL]:
    """The libgomps this process has loaded (torch's; another package may bring its own copy), by their paths in
    /proc/self/maps, read at each call (a later import may load another); none where there is none (macOS's
    libomp, a torch built without OpenMP)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libgomp" in ln and "/" in ln}
    except OSError:
        return []
    libs = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same library, not a second copy
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            libs.append(lib)
        except (OSError, AttributeError):  # a libgomp before OpenMP 5.0 (GCC 9) has no omp_pause_resource_all
            continue
    return libs


def release_openmp_threads() -> bool:
    """End the calling thread's OpenMP pools: their idle workers exit (joined before this returns). A later parallel
    region on this thread makes a new one. Call it on a thread that ran torch work and will not step the engine.
    True when a libgomp took the call (-1: inside a parallel region, never ours)."""
    return any([lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0 for lib in _libgomps()])
