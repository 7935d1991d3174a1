"""Building the CPU kernels in C (kernels/cpu_attention.c, kernels/cpu_gemm.c) at run time, with the system's C
compiler (gcc or clang: `cc`, as Triton needs), for this CPU (-march=native), into `<cache>/cpu-kernels/` under a
name that hashes the source, the flags, the compiler and the CPU's model and flags: a network volume shared by
unlike machines keeps one build per kind. A cached build loads in about a millisecond; a compile takes about 0.5 s
of one core."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger("engine")

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo), empty where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and flags (Linux), else the platform's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() + platform.machine()


def local_headers(source: Path) -> list[str]:
    """The headers beside `source` that it includes (`#include "name.h"`; not the headers those include: ours
    include none)."""
    return re.findall(r'^\s*#\s*include\s+"([^"/]+)"', source.read_text(), re.M)


def source_text(source: Path) -> str:
    """What a build compiles: the source and its local headers (the key changes when either does)."""
    return "\0".join([source.read_text(), *((source.parent / h).read_text() for h in local_headers(source))])


def library_path(cache_dir: Path, source: Path, defines: tuple[str, ...], cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = "\0".join([source_text(source), " ".join(FLAGS), " ".join(defines), version, _cpu_identity()])
    tag = "-".join(d.removeprefix("-D").replace("=", "").lower() for d in defines)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{source.stem}{'-' + tag if tag else ''}-{digest}.so"


def build(cache_dir: Path, source: Path, defines: tuple[str, ...] = (), on_compile=lambda path: None) -> Path:
    """The shared object for `source` built with `defines` in `cache_dir`, compiled unless it is there (then
    `on_compile(path)` is called first). Raises RuntimeError saying why it cannot be had (no compiler, a failed
    compile: the compiler's message)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    path = library_path(cache_dir, source, defines, cc)
    if path.exists():
        return path
    on_compile(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".so.tmp", dir=path.parent)
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, *defines, "-o", tmp, str(source), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-600:]}")
        os.replace(tmp, path)  # atomic: workers sharing the volume never load half a file
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


class NativeKernel:
    """A compiled CPU kernel shared by every engine in the process (`get`, one per key): loaded at once when its
    build is cached, else built by a thread. `lib` is None until it is loaded, and stays None when it cannot be
    (`error` says why: the log says it once, and the caller keeps its torch path). Subclasses name the source, the
    defines for a key, what the loaded library needs (`setup`), and what the log calls it."""

    SOURCE: Path
    WHAT = "native kernel"  # the log's name for it
    FALLBACK = "the torch path stays"  # what happens without it
    _all: dict
    _lock = threading.Lock()

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls._all = {}

    def __init__(self, key, cache_dir: Path):
        self.key, self.cache_dir = key, Path(cache_dir)
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self._done = threading.Event()

    def defines(self) -> tuple[str, ...]:
        return ()

    def label(self) -> str:
        return " ".join(self.defines()) or self.SOURCE.stem

    def setup(self, lib: ctypes.CDLL) -> None:
        """Argument types, and what must run once after loading (raises RuntimeError when it cannot run here)."""

    @classmethod
    def get(cls, key, cache_dir: Path, wait: bool = False):
        with cls._lock:
            k = cls._all.get(key)
            if k is None:
                k = cls._all[key] = cls(key, cache_dir)
                threading.Thread(target=k._make, name=f"{cls.SOURCE.stem}-build", daemon=True).start()
        if wait:
            k.wait()
        return k

    @classmethod
    def current(cls, key=None):
        """The kernel for `key` in this process: loaded, in its build, or failed; None when nothing asked for it."""
        return cls._all.get(key)

    @classmethod
    def loaded(cls, key=None):
        """The kernel for `key` if it is loaded now (never waits)."""
        k = cls._all.get(key)
        return k if k is not None and k.lib is not None else None

    def wait(self) -> bool:
        """Block until the build has ended; True when the kernel is loaded."""
        self._done.wait()
        return self.lib is not None

    def _make(self) -> None:
        t0 = time.perf_counter()
        try:
            built = []
            lib = ctypes.CDLL(str(build(self.cache_dir, self.SOURCE, self.defines(), on_compile=built.append)))
            self.setup(lib)  # its libgomp.so.1 is the one torch loaded: one OpenMP pool
            self.lib = lib
            how = f"built in {time.perf_counter() - t0:.1f}s" if built else "loaded"
            log.info("%s: native kernel (%s) %s", self.WHAT, self.label(), how)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            self.error = str(e)
            log.warning("%s: native kernel unavailable, %s: %s", self.WHAT, self.FALLBACK, e)
        finally:
            self._done.set()
