"""The CPU KV pool's automatic size (KV_CACHE_MEMORY unset): a capacity from the model and the concurrency, capped by
the memory the machine has at start. `cpu_pool_bytes` is the arithmetic, on plain numbers (tests simulate them);
`read_host_memory` is the one reading of the machine it takes (/proc/meminfo and the cgroup's limit). No torch.
`cpu_quota` reads the cgroup's CPU quota the same way, for the thread count (engine/cpu_threads.py).

The capacity is address space, not memory: the pool is an anonymous mapping whose pages are touched only as the
block manager opens its region (engine/kv_cache.py's Prefaulter), so a large capacity costs nothing until the load
uses it, and the cap keeps a full pool within what the machine can hold."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
UNKNOWN_CAP = GIB  # the pool's cap when neither /proc/meminfo nor a cgroup limit can be read (the old default)
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge number (2^63 rounded down to a page)


@dataclass(frozen=True)
class HostMemory:
    """The memory this process may use, read once at start."""

    available: int | None  # bytes: MemAvailable, or the cgroup's limit where lower; None: neither readable
    source: str  # where the number came from, for the start-up log


def read_host_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> HostMemory:
    """MemAvailable from /proc/meminfo, or this process's cgroup limit where it is lower (_cgroup_limit), or under
    strict overcommit the commit limit left where that is lower (the pool's whole mapping is charged at once,
    touched or not). The cgroup's limit itself, not what it has left: the container's other processes are not this
    worker's to count."""
    kib = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in _read(proc / "meminfo").splitlines() if ln.split()[1:]}
    found = []  # (bytes, what it is)
    if "MemAvailable" in kib:
        found.append((kib["MemAvailable"], f"MemAvailable {_gib(kib['MemAvailable'])}"))
    if (limit := _cgroup_limit(proc, cgroup)) is not None:
        found.append((limit[0], f"the cgroup limit {_gib(limit[0])} ({limit[1]})"))
    if _read(proc / "sys" / "vm" / "overcommit_memory").strip() == "2" and "CommitLimit" in kib:
        left = max(0, kib["CommitLimit"] - kib.get("Committed_AS", 0))
        found.append((left, f"the commit limit left {_gib(left)} (vm.overcommit_memory=2)"))
    if found:
        return HostMemory(*min(found))
    return HostMemory(None, "neither /proc/meminfo nor a cgroup limit readable")


def memory_room(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process could still take now: MemAvailable, or where lower what its cgroup limits leave (limit
    less usage); None when neither can be read. For what is allocated after start (the CPU's packed weight
    copies: engine/layers/dense.py)."""
    kib = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in _read(proc / "meminfo").splitlines() if ln.split()[1:]}
    found = [kib["MemAvailable"]] if "MemAvailable" in kib else []
    for limit, path in _cgroup_limits(proc, cgroup):
        usage_name = "memory.current" if path.endswith("memory.max") else "memory.usage_in_bytes"
        if (usage := _read(Path(path).with_name(usage_name)).strip()).isdigit():
            found.append(max(0, limit - int(usage)))
    return min(found) if found else None


def _cgroup_limit(proc: Path, cgroup: Path) -> tuple[int, str] | None:
    """The lowest memory limit on this process's cgroup and its ancestors, and the file that set it; None: none."""
    found = _cgroup_limits(proc, cgroup)
    return min(found) if found else None


def _cgroup_limits(proc: Path, cgroup: Path) -> list[tuple[int, str]]:
    """Each memory limit on this process's cgroup and its ancestors (v2 memory.max, v1 memory.limit_in_bytes), and
    the file that set it."""
    found = []
    for d, v2 in _cgroup_dirs(proc, cgroup, "memory"):
        f = d / ("memory.max" if v2 else "memory.limit_in_bytes")
        text = _read(f).strip()  # v2: "max" when unlimited; v1: a huge number
        if text.isdigit() and int(text) < _NO_LIMIT:
            found.append((int(text), str(f)))
    return found


def cpu_quota(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> tuple[float, str] | None:
    """The lowest CPU quota on this process's cgroup and its ancestors, in CPUs (a container's --cpus, a Kubernetes
    CPU limit: quota / period, v2 cpu.max, v1 cpu.cfs_quota_us and cpu.cfs_period_us), and the file that set it;
    None: no quota. A quota throttles the whole cgroup once its threads used it up within a period (100 ms), so
    threads beyond it only spin and wait (engine/cpu_threads.py's claim_threads)."""
    found = []
    for d, v2 in _cgroup_dirs(proc, cgroup, "cpu"):
        if v2:
            f, parts = d / "cpu.max", _read(d / "cpu.max").split()  # "max 100000" when unlimited
        else:
            f = d / "cpu.cfs_quota_us"  # -1 when unlimited
            parts = [_read(f).strip(), _read(d / "cpu.cfs_period_us").strip()]
        if len(parts) == 2 and all(p.isdigit() for p in parts) and int(parts[1]) > 0:
            found.append((int(parts[0]) / int(parts[1]), str(f)))
    return min(found) if found else None


def physical_cores(cpus: set[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """How many cores `cpus` (logical CPU numbers) sit on, from sysfs: their distinct lists of a core's CPUs
    (core_cpus_list; thread_siblings_list on older kernels; else the (package, core_id) pair); None where the
    topology cannot be read. torch's own thread count is one a core where cores run two threads."""
    cores = set()
    for c in cpus:
        topo = sysfs / f"cpu{c}" / "topology"
        key = _read(topo / "core_cpus_list").strip() or _read(topo / "thread_siblings_list").strip()
        if not key and (core := _read(topo / "core_id").strip()):
            key = (_read(topo / "physical_package_id").strip(), core)
        if not key:
            return None
        cores.add(key)
    return len(cores) or None


def _cgroup_dirs(proc: Path, cgroup: Path, controller: str) -> list[tuple[Path, bool]]:
    """This process's cgroup directory for `controller` and each ancestor up to the hierarchy's root, each with
    whether it is v2's unified hierarchy (no controller list in /proc/self/cgroup). Inside a container's cgroup
    namespace its own cgroup shows as /."""
    dirs = []
    for line in _read(proc / "self" / "cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root = cgroup
        elif controller in controllers.split(","):  # v1: mounted as the controller's name (often a link to the
            root = cgroup / controller  # joint mount, "cpu" -> "cpu,cpuacct"), else as the joint name
            root = root if root.exists() else cgroup / controllers
        else:
            continue
        own = root / path.strip().lstrip("/")
        for d in (own, *own.parents):
            dirs.append((d, controllers == ""))
            if d == root:
                break
    return dirs


def cpu_pool_bytes(
    *, bytes_per_block: int, blocks_per_seq: int, max_num_seqs: int, host: HostMemory, ranks: int = 1
) -> tuple[int, str]:
    """The pool's bytes and why, for the start-up log: room for `max_num_seqs` sequences of `blocks_per_seq` blocks
    (the full context), capped at half of the memory available at start (shared by `ranks` tensor-parallel ranks on
    one machine; UNKNOWN_CAP when it cannot be read). One full-length sequence fits whenever the cap allows it,
    since the capacity is whole sequences."""
    want = max_num_seqs * blocks_per_seq * bytes_per_block
    half = host.available // 2 if host.available is not None else UNKNOWN_CAP
    cap = half // ranks
    seqs = f"MAX_NUM_SEQS={max_num_seqs} full-context sequences"
    what = f"half of {host.source}" if host.available is not None else f"{_gib(UNKNOWN_CAP)}, {host.source}"
    what += f", shared by {ranks} ranks" if ranks > 1 else ""
    if want <= cap:
        return want, f"automatic: room for {seqs} (within {what})"
    return cap, f"automatic: capped at {what} (room for {seqs} would take {_gib(want)})"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def madvise(spans, advice: int) -> int:
    """madvise(2) over each (address, length) span, rounded out to whole pages: 0, or the errno of the first call
    that failed. ctypes releases the GIL in each call. Raises OSError where libc has no madvise (not Linux/glibc)."""
    import ctypes
    import mmap

    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError) as e:
        raise OSError(f"no madvise here ({e})") from e
    page = mmap.PAGESIZE
    for start, length in spans:
        first, end = start - start % page, -(-(start + length) // page) * page
        if call(ctypes.c_void_p(first), ctypes.c_size_t(end - first), advice) != 0:
            return ctypes.get_errno() or -1
    return 0


HEAP_KEEP = 1 << 30  # bytes of freed heap malloc keeps before giving the top back by itself (M_TRIM_THRESHOLD)
HEAP_LARGE = 1 << 28  # allocations up to this come from the heap, not a map of their own (M_MMAP_THRESHOLD)


def keep_freed_memory() -> bool:
    """Let a CPU step's large temporaries reuse the memory the last step freed, instead of each being mapped afresh
    and faulted in page by page. With glibc's defaults, a SmolLM2 prefill chunk of 2048 tokens took 100-230
    thousand page faults (2.5 us each on the Xeon VM); with these, about 12 thousand (its new KV blocks), and the
    step ran 1.33x faster (1192 against 1582 ms, 6 alternations; docs/decisions.md). What the heap keeps is given
    back by trim_heap, which the engine loop calls (engine/async_engine.py). True when glibc took both settings."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        return libc.mallopt(-1, HEAP_KEEP) == 1 and libc.mallopt(-3, HEAP_LARGE) == 1  # M_TRIM_, M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def trim_heap() -> tuple[float, int]:
    """Give the heap's free pages back to the OS (glibc's malloc_trim): (seconds it took, bytes of RSS returned).
    Activations of the largest steps so far stay in malloc's arenas once freed, so a worker's RSS kept the
    high-water mark of every burst. The engine loop calls it (engine/async_engine.py). Elsewhere than glibc it does
    nothing."""
    import ctypes
    import time

    before, t = _rss_bytes(), time.perf_counter()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return time.perf_counter() - t, max(0, before - _rss_bytes())


def _rss_bytes() -> int:
    """This process's resident set (Linux /proc/self/statm; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_breakdown() -> str:
    """Where this process's memory is, for the engine's status line (bench/soak.py reads it per minute): the
    resident set split into anonymous and file-backed pages (the weights' maps, the page cache), glibc malloc's heap
    in use and free inside it, its mmapped chunks, and Python's allocated blocks."""
    import ctypes
    import sys

    fields = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) / 1024
    except (OSError, ValueError):
        pass
    heap = ""
    try:

        class _Mallinfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in
                        ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                         "keepcost")]  # fmt: skip

        fn = ctypes.CDLL(None).mallinfo2
        fn.restype = _Mallinfo2
        m = fn()
        heap = f", heap {m.uordblks / 2**20:.0f} MiB used {m.fordblks / 2**20:.0f} free {m.hblkhd / 2**20:.0f} mmapped"
    except (OSError, AttributeError):
        pass
    return (
        f"anon {fields.get('RssAnon', 0):.0f} MiB, file {fields.get('RssFile', 0):.0f} MiB{heap}, "
        f"python blocks {sys.getallocatedblocks()}"
    )
