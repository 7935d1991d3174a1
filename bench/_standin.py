"""A stand-in Triton driver: our kernels compiled (never launched) for a chosen NVIDIA GPU on a CPU-only machine.

Triton's compiler and the ptxas it bundles (ptxas-blackwell for sm100+) run anywhere; only loading a cubin and
launching it need a GPU. `install(arch)` turns this process into a stand-in for that GPU until the next install:

- the driver answers Triton's three questions (the target, a device, a stream) as the GPU would; its device id is
  the arch, so each JITFunction keeps every arch's compiled kernels apart (they are cached per device);
- JITFunction.run runs with warmup=True: Triton specializes, compiles (or loads from its cache, keyed by the hash of
  source, target, options and specialization) and returns the CompiledKernel; nothing launches. Every kernel is
  recorded once, by that hash, with the case that reached it first, or the error it raised;
- the caller runs its cases inside `kernels._common.target(ARCHS[arch])`, under which CPU tensors report the GPU's
  capability, SM count and shared memory to our launchers: they pick that GPU's tiles, splits and dot modes.

Registers and spills come from ptxas --verbose, with Triton's own flags: Triton runs it with -v already, and prints
the log when knobs.nvidia.dump_ptxas_log is set, so a cold compile's log is captured as it happens; a kernel that
came from Triton's cache is given to ptxas again. Either way the numbers are kept per hash in `stats_dir`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from kernels._common import GPUFacts

# The GPUs Runpod rents, one per arch: capability, SMs (only the split count reads them) and the shared memory a
# block may opt into (CUDA programming guide, "Technical Specifications"), the limit a kernel is checked against.
ARCHS: dict[int, GPUFacts] = {
    80: GPUFacts((8, 0), 108, 163 * 1024),  # A100
    86: GPUFacts((8, 6), 84, 99 * 1024),  # A40, RTX A6000 (RTX 3090: 82 SMs)
    89: GPUFacts((8, 9), 142, 99 * 1024),  # L40S (L4: 58 SMs, RTX 4090: 128)
    90: GPUFacts((9, 0), 132, 227 * 1024),  # H100 SXM, H200
    120: GPUFacts((12, 0), 170, 99 * 1024),  # RTX 5090
}
GPU_NAMES = {80: "A100", 86: "A40, RTX A6000", 89: "L40S, L4, RTX 4090", 90: "H100, H200", 120: "RTX 5090"}
REGISTERS_PER_BLOCK = 64 * 1024  # every arch above: a block's threads x registers per thread must fit


class StandInDriver:
    """Only what JITFunction.run(warmup=True) and compile() ask of a driver."""

    def __init__(self, arch: int):
        self.arch = arch

    @classmethod
    def is_active(cls) -> bool:
        return False  # never chosen by Triton's own driver discovery

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@dataclass
class Compiled:
    """One kernel specialization, compiled for the arch."""

    name: str  # the @triton.jit function
    case: str  # the first case that reached it
    spec: str  # its specialization: constexpr values, pointer dtypes, what is divisible by 16
    kernel: object  # triton.compiler.CompiledKernel
    ptxas_log: str  # ptxas --verbose output when this run compiled it, else ""


@dataclass
class Recorder:
    case: str = ""
    kernels: dict[str, Compiled] = field(default_factory=dict)  # by Triton's hash
    errors: list[tuple[str, str, str]] = field(default_factory=list)  # (case, kernel, message)

    def add(self, fn: JITFunction, kernel, log: str) -> None:
        if kernel.hash not in self.kernels:
            self.kernels[kernel.hash] = Compiled(fn.__name__, self.case, _spec(kernel.src), kernel, log)


def _spec(src) -> str:
    """`src`'s specialization (a triton ASTSource): constexprs (ints equal to 1 included), pointer dtypes, and the
    pointers and ints Triton found divisible by 16 (each a variant of its own)."""
    names = src.fn.arg_names
    values = {names[k[0]]: v for k, v in src.constants.items()}
    parts = [f"{n}={values[n]}" for n, t in src.signature.items() if t == "constexpr" and n in values]
    parts += [f"{n}:{t}" for n, t in src.signature.items() if t.startswith("*")]
    div16 = [names[k[0]] for k, attrs in src.attrs.items() if ["tt.divisibility", 16] in [list(a) for a in attrs]]
    return " ".join(parts + [f"div16={','.join(div16)}"])


_recorder: Recorder | None = None  # the installed arch's


def install(arch: int) -> Recorder:
    """Make this process a stand-in for `arch` (see module doc); returns the recorder of what compiles for it."""
    global _recorder
    assert not knobs.runtime.interpret, "TRITON_INTERPRET must be 0: under it @triton.jit makes no JITFunction"
    driver.set_active(StandInDriver(arch))
    knobs.nvidia.dump_ptxas_log = True  # Triton's ptxas -v log, printed as each kernel compiles: captured below
    if _recorder is None:
        JITFunction.run = _compile_only(JITFunction.run)
    _recorder = Recorder()
    return _recorder


def _compile_only(launch):
    """JITFunction.run with warmup forced on: compile (or load from Triton's cache) and record; never launch."""

    def run(self, *args, grid, warmup, **kwargs):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:
            _recorder.errors.append((_recorder.case, self.fn.__name__, one_line(e)))
            raise
        _recorder.add(self, kernel, out.getvalue())
        return kernel

    return run


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and the most telling line of its message (Triton's compile errors
    print the source around the failing line first, the reason last)."""
    lines = [s.strip() for s in str(e).strip().splitlines() if s.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


def parse_ptxas(log: str) -> dict | None:
    """Registers, spill bytes and stack frame of the one kernel in a ptxas --verbose log; None if it has none."""
    regs = _REGS.search(log)
    if regs is None:
        return None
    spills, stack = _SPILLS.search(log), _STACK.search(log)
    return dict(
        regs=int(regs.group(1)),
        spill_stores=int(spills.group(1)) if spills else 0,
        spill_loads=int(spills.group(2)) if spills else 0,
        stack=int(stack.group(1)) if stack else 0,
    )


def ptxas_verbose(ptx: str, arch: int, fp_fusion: bool) -> str:
    """Run the bundled ptxas on `ptx` as Triton's make_cubin does, with --verbose; returns its log."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        Path(src).write_text(ptx)
        fmad = [] if fp_fusion else ["--fmad=false"]
        cmd = [get_ptxas(arch).path, "-lineinfo", *fmad, "--verbose", "--regAllocOptLevel=2"]
        cmd += [f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", src + ".o"]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stderr


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
_LOCAL = re.compile(r"\b(?:STL|LDL)\b")


def spills_in_loops(cubin: bytes) -> int:
    """Local-memory loads and stores (a spill's traffic) inside a loop of the kernel's SASS (nvdisasm, bundled): at
    or after a backward branch's target and not past the branch. A spill outside every loop costs once per
    program: ptxas trades a few bytes there for a register count that fits one more block per SM."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", str(path)], check=True, capture_output=True, text=True)
    labels, branches, local, pending = {}, [], [], []
    for line in sass.stdout.splitlines():
        if m := _LABEL.match(line.strip()):
            pending.append(m.group(1))
        elif m := _SASS.search(line):
            addr = int(m.group(1), 16)
            labels.update((name, addr) for name in pending)
            pending = []
            if b := _BRANCH.search(m.group(2)):
                branches.append((addr, b.group(1)))
            if _LOCAL.search(m.group(2)):
                local.append(addr)
    assert local, "ptxas reported a spill, but the SASS has no local-memory access: the parse is wrong"
    loops = [(labels[t], a) for a, t in branches if labels.get(t, a + 1) <= a]
    return sum(any(lo <= x <= hi for lo, hi in loops) for x in local)


def kernel_stats(c: Compiled, arch: int, stats_dir: Path) -> dict:
    """c's registers and spills (parse_ptxas; a spill's loop traffic: spills_in_loops), kept in stats_dir by
    Triton's hash: a warm run runs no ptxas."""
    path = stats_dir / f"{c.kernel.hash}.json"
    if path.is_file():
        return json.loads(path.read_text())
    st = parse_ptxas(c.ptxas_log) or parse_ptxas(ptxas_verbose(c.kernel.asm["ptx"], arch, _fp_fusion(c.kernel)))
    assert st is not None, f"ptxas --verbose printed no register count for {c.name}"
    spilled = st["spill_stores"] or st["spill_loads"]
    st["loop_spills"] = spills_in_loops(c.kernel.asm["cubin"]) if spilled else 0
    stats_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(st))
    tmp.replace(path)  # atomic: parallel workers never read half a file
    return st


def _fp_fusion(kernel) -> bool:
    return getattr(kernel.metadata, "enable_fp_fusion", True)
