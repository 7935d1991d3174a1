"""Stream a checkpoint's safetensors weights: on CPU views of the files' memory maps (which a loader may keep as its
parameters: `mapped`), faulted in by one thread ahead of the consumer; on CUDA parallel reader threads through pinned
staging buffers, with bounded read-ahead."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from engine.errors import UnsupportedModelError
from engine.host_memory import madvise
from engine.weights.header import Entry, entries, torch_dtype
from engine.weights.locate import safetensors_files
from engine.weights.read_ahead import DEPTH, READERS, progress

_PAGE = 4096
_FAULT_CHUNK = 32 << 20  # bytes a CPU load faults in per call (_FaultIn)


def iter_weights(
    path: Path, device="cpu", *, readers: int = READERS, depth: int = DEPTH
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint at `path`, already on `device`. The consumer
    copies each into its own parameters and drops it, so the checkpoint is never held twice."""
    yield from iter_safetensors(safetensors_files(path), device, readers=readers, depth=depth)


def iter_safetensors(
    files: list[Path], device="cpu", *, readers: int = READERS, depth: int = DEPTH, desc: str = "Loading weights"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of `files` in the order a sequential read would: file by file, each
    file's tensors in the order of their bytes. So a consumer that quantizes a layer as soon as its weights are in
    still has about one layer pending, and the files are read front to back. A file that cannot be mapped or read
    is an UnsupportedModelError naming it. Closing the generator early, or an exception in the consumer, stops and
    joins every thread it started.

    CPU (_iter_mapped): each tensor is a view of its file's private memory map, with no copy. A consumer may keep
    it as its parameter (`mapped` says whether a tensor is one); its memory is then the page cache's. One thread
    faults the files' pages in ahead of the consumer, so the consumer handles views without waiting on the reads.
    CUDA (engine/weights/read_ahead.py): `readers` threads read into pinned staging buffers and copy to the device,
    at most `depth` tensors ahead of the consumer."""
    import torch

    dev = torch.device(device)
    items = [(i, e) for i, f in enumerate(files) for e in entries(f)]
    if dev.type == "cpu":
        yield from _iter_mapped(files, items, desc)
        return
    from engine.weights.read_ahead import iter_cuda

    yield from iter_cuda(files, items, dev, readers=readers, depth=depth, desc=desc)


def _iter_mapped(files: list[Path], items: list[tuple[int, Entry]], desc: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The CPU path: views of the files' maps, handed over at once, while a _FaultIn thread faults the maps' pages
    in, front to back. The consumer keeps most views as they are (engine/models/loading.py `Kept`) and reads only
    what it copies, so it does not wait for the reads; the generator ends once every page is in, so the load's
    time includes the whole read. (A reader thread per tensor, as on CUDA, cost 40-50 ms for SmolLM2's 257 MiB
    here, against 15-35 ms for this: its Python work between tensors took turns with the consumer's for the GIL.)"""
    maps: list[_Mapped] = []
    fault_in = None
    try:
        for f in files:
            try:
                maps.append(_Mapped(f))
            except (OSError, ValueError) as e:  # the file vanished, cannot be mapped, ...
                raise UnsupportedModelError(f"cannot read weights file {f}: {e} (incomplete download?)") from e
        fault_in = _FaultIn(maps)
        with progress(len(items), desc) as bar:
            for fi, e in items:
                yield e.name, maps[fi].view(e)
                bar.update(1)
        fault_in.join()
    finally:  # also on close() and on the consumer's exceptions
        if fault_in is not None:
            fault_in.stop()
        for m in maps:
            m.close()  # the map itself lives on in the views a consumer kept


# ---- CPU: the files' memory maps ----------------------------------------------------------------------------
_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22
_LIVE: dict[int, int] = {}  # start address -> end of each map an iter_safetensors call holds open (see `mapped`)
_live_lock = threading.Lock()


class _Mapped:
    """One weights file as a private (copy-on-write) memory map and a uint8 tensor over it. Views of it are the
    file's bytes in the page cache: no copy, and the kernel reads ahead of them (MADV_WILLNEED at open: on a cold
    cache the whole file is being read while the first tensors are handed over)."""

    def __init__(self, f: Path):
        import torch

        with f.open("rb") as fh:
            self.mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)  # keeps the map alive while any view does
        self.start = self.base.data_ptr()
        self.end = self.start + self.base.numel()
        try:
            madvise([(self.start, self.base.numel())], _MADV_WILLNEED)  # advice: its failure changes no result
        except OSError:  # not Linux/glibc: the _FaultIn thread's touches read the file
            pass
        with _live_lock:
            _LIVE[self.start] = self.end

    def view(self, e: Entry) -> torch.Tensor:
        dtype = torch_dtype(e.dtype)
        raw = self.base[e.start : e.start + e.nbytes]
        if e.start % dtype.itemsize:  # a tensor not aligned to its dtype in the file: a copy, aligned
            raw = raw.clone()
        return raw.view(dtype).view(e.shape)

    def close(self) -> None:
        with _live_lock:
            _LIVE.pop(self.start, None)


def mapped(t: torch.Tensor) -> bool:
    """Whether `t` is a view of a weights file that an iter_safetensors call is handing out now: memory that
    holds the file's bytes and stays valid while the view lives (a loader may keep it instead of copying)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return False
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    with _live_lock:
        return any(s <= lo and hi <= e for s, e in _LIVE.items())


class _FaultIn:
    """A thread that faults the pages of `maps` in, file by file, front to back, _FAULT_CHUNK bytes at a time: the
    order the consumer takes its views in. MADV_POPULATE_READ (Linux 5.14+; a ctypes call, which releases the GIL),
    else a read of one byte per page (numpy: its reduction releases the GIL too). On a cold page cache this is
    where the disk is read, the maps' MADV_WILLNEED read-ahead ahead of it. stop() ends it after the current chunk
    and joins it."""

    def __init__(self, maps: list[_Mapped]):
        self.maps, self.stopped = maps, False
        self.thread = threading.Thread(target=self._run, name="weights-fault-in", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        populate = True
        for m in self.maps:
            for off in range(0, m.end - m.start, _FAULT_CHUNK):
                if self.stopped:
                    return
                n = min(_FAULT_CHUNK, m.end - m.start - off)
                try:
                    populate = populate and madvise([(m.start + off, n)], _MADV_POPULATE_READ) == 0
                except OSError:  # not Linux/glibc
                    populate = False
                if not populate:
                    _touch(m.base[off : off + n])

    def join(self) -> None:
        self.thread.join()

    def stop(self) -> None:
        self.stopped = True
        self.thread.join()


def _touch(b: torch.Tensor) -> None:
    """Read one byte of each page of the uint8 tensor `b` (a fault maps the pages around it too)."""
    a = b.numpy()
    int(a[::_PAGE].sum()) + int(a[-1:].sum())
