"""What every kernel file shares: the backend dispatch (which path an op takes), Triton helpers and constants.

Dispatch: each public op runs the Triton launcher on CUDA tensors and the torch reference elsewhere.
`set_backend("triton")` forces the Triton path on CPU too (only meaningful under TRITON_INTERPRET=1, which
the tests set before importing this package); `set_backend("torch")` forces the references. The engine
uses `backend(name)`, a per-thread override, so two engines in one process cannot change each other.

`round_to` is the fp32 -> x.dtype rounding every kernel here uses: Triton's interpreter casts fp32 -> bf16 by
truncation (even with fp_downcast_rounding="rtne"), while torch and the GPU round to nearest even, so bf16
rounding is done with integer ops that give RNE everywhere.

GPU facts: what a launcher decides from the GPU (the capability for tile sizes and fp8, the SM count for
flash-decoding splits, 16-bit tl.dot operands) it reads from `gpu_facts(t)`, never from `t.is_cuda` or
torch.cuda directly, so that `target(facts)` can make CPU tensors answer as a chosen GPU would: under it, and a
stand-in Triton driver, bench/compile_arch.py compiles every kernel for sm80-sm120 on a CPU-only machine, the
launchers taking the same decisions they take on that GPU."""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value

_BACKEND = "auto"  # auto | torch | triton
_local = threading.local()


def set_backend(name: str) -> None:
    global _BACKEND
    _BACKEND = _check(name)


@contextlib.contextmanager
def backend(name: str):
    """Use `name` for ops called from this thread inside the block."""
    prev = getattr(_local, "mode", None)
    _local.mode = _check(name)
    try:
        yield
    finally:
        _local.mode = prev


def _check(name: str) -> str:
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"kernel backend must be auto, torch or triton, not {name!r}")
    return name


def use_triton(t) -> bool:
    """True when `t`'s op should run the Triton kernel."""
    mode = getattr(_local, "mode", None) or _BACKEND
    if mode == "torch":
        return False
    return mode == "triton" or t.is_cuda


@dataclass(frozen=True)
class GPUFacts:
    capability: tuple[int, int]  # compute capability (8, 0) for sm80
    sms: int  # streaming multiprocessors
    max_shared: int  # bytes of shared memory a block may opt into


_DEVICE_FACTS: dict[int, GPUFacts] = {}  # per CUDA device index: asked of the driver once, read every launch
_TARGET: GPUFacts | None = None  # the stand-in's GPU (`target`), or None


def gpu_facts(t: torch.Tensor | torch.device) -> GPUFacts | None:
    """The GPU a kernel for `t` (a tensor or a device) is compiled for: its CUDA device's, else the stand-in's
    `target` when one is set, else None (CPU: the Triton interpreter)."""
    device = t if isinstance(t, torch.device) else t.device
    if device.type != "cuda":
        return _TARGET
    index = device.index if device.index is not None else torch.cuda.current_device()
    facts = _DEVICE_FACTS.get(index)
    if facts is None:
        p = torch.cuda.get_device_properties(index)
        facts = GPUFacts((p.major, p.minor), p.multi_processor_count, p.shared_memory_per_block_optin)
        _DEVICE_FACTS[index] = facts
    return facts


@contextlib.contextmanager
def target(facts: GPUFacts):
    """CPU tensors report `facts` to the launchers inside the block (bench/compile_arch.py's stand-in, which
    compiles and never launches). Process-wide, as the Triton driver it goes with is."""
    global _TARGET
    prev, _TARGET = _TARGET, facts
    try:
        yield
    finally:
        _TARGET = prev


def native_dot_for(t: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether tl.dot takes 16-bit operands (`dtype`, default t's) as they are: on a GPU, where they run on the
    tensor cores. In the CPU interpreter they are upcast to fp32 first: its bf16 tl.dot is wrong (triton#11584)."""
    return gpu_facts(t) is not None and (dtype or t.dtype) in (torch.float16, torch.bfloat16)


# ---- Triton, imported at the first launch ----------------------------------------------------------------------
class _NotLoaded:
    """`tl` before load_triton(): kernel bodies name it only when Triton compiles or interprets them."""

    def __getattr__(self, name):
        raise RuntimeError(f"tl.{name} before kernels.load_triton(): Triton is imported at the first launch")


tl = _NotLoaded()  # every kernel module imports this name; load_triton() rebinds it to triton.language there
_KERNELS: list[Kernel] = []
_load_lock = threading.Lock()
_loaded = False


class Kernel:
    """A `@jit` function: triton.jit's JITFunction once load_triton() has run. Importing triton costs about 0.3 s
    of a cold start (its runtime and libtriton), and the CPU worker, which runs the torch references, never
    launches a kernel; so no kernel module imports triton, and the first launch (or attribute read) loads it."""

    __slots__ = ("fn", "options", "jitted")

    def __init__(self, fn, options: dict):
        self.fn, self.options, self.jitted = fn, options, None

    def __getitem__(self, grid):
        return self.load()[grid]

    def __getattr__(self, name):  # JITFunction's attributes (arg_names, cache, ...), for the benches and tests
        return getattr(self.load(), name)

    def load(self):
        if self.jitted is None:
            load_triton()
        return self.jitted


def jit(fn=None, **options):
    """triton.jit, deferred to load_triton(); used as `@jit` or `@jit(do_not_specialize=[...])`."""
    if fn is None:
        return lambda f: jit(f, **options)
    if _loaded:  # a kernel module imported after the load
        import triton

        return triton.jit(fn, **options)
    k = Kernel(fn, options)
    _KERNELS.append(k)
    return k


def load_triton() -> None:
    """Import triton and jit every kernel, once: the engine calls it at start when it runs the Triton kernels
    (TRITON_INTERPRET is read here, at the jit, as triton.jit reads it). Each kernel module's globals then name the
    real objects, `tl` and the JITFunctions, as Triton's compiler and interpreter resolve a kernel's globals (the
    helpers it calls included) when they run it."""
    global _loaded
    with _load_lock:
        if _loaded:
            return
        import triton
        import triton.language

        for k in _KERNELS:
            k.jitted = triton.jit(k.fn, **k.options)
        placeholder = tl  # (this module's own `tl` is rebound in the loop)
        for name, mod in list(sys.modules.items()):
            if name == "kernels" or name.startswith("kernels."):
                g = vars(mod)
                for attr, value in list(g.items()):
                    if value is placeholder:
                        g[attr] = triton.language
                    elif isinstance(value, Kernel):
                        g[attr] = value.jitted
        _loaded = True


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 (a launcher's block sizes), without importing triton."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@jit
def round_to(x, DT: tl.constexpr):
    """fp32 `x` rounded to dtype DT (nearest even), returned as fp32; `.to(DT)` of the result is exact."""
    if DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)  # round half to even at bit 16
        r = ((b >> 16) << 16).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)  # keep NaN a NaN
    elif DT == tl.float32:
        return x
    else:
        return x.to(DT).to(tl.float32)  # fp16: the interpreter's numpy cast already rounds to nearest even


_ONES: dict[torch.device, torch.Tensor] = {}  # the 1.0 scale of 16-bit caches, made once per device


def scale_tensor(x, device) -> torch.Tensor:
    """An attention kernel's fp8 KV scale as a [1] fp32 tensor on `device`; None: 1.0 (a 16-bit cache). Made once
    per device: a fresh 1.0 per call would be a blocking host-to-device copy per layer."""
    if x is None:
        return _ONES[device] if device in _ONES else _ONES.setdefault(device, torch.ones(1, device=device))
    return torch.as_tensor(x, dtype=torch.float32, device=device).reshape(1)
