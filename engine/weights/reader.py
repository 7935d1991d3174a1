"""Stream a checkpoint's safetensors weights: parallel reader threads, bounded read-ahead; on CPU views of the
files' memory maps (which a loader may keep as its parameters: `mapped`), pinned staging on CUDA."""

from __future__ import annotations

import json
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from engine.errors import UnsupportedModelError
from engine.host_memory import madvise
from engine.weights.locate import safetensors_files

# Reader threads: up to 4, one per 4 cores. On a small box the readers only compete with the consumer's copies:
# with 2 cores and a warm page cache, 4 readers took SmolLM2's load from 0.05 s (1 reader) to 0.12-0.25 s.
_READERS = max(1, min(4, (os.cpu_count() or 1) // 4))
_DEPTH = 8  # tensors read ahead of the consumer, at most
_CHUNK = 32 << 20  # bytes per pinned staging buffer (CUDA; two per reader)
_PAGE = 4096
_TOUCH_MIN = 256 << 10  # bytes: smaller CPU tensors are not faulted in ahead


def iter_weights(
    path: Path, device="cpu", *, readers: int = _READERS, depth: int = _DEPTH
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint at `path`, already on `device`. The consumer
    copies each into its own parameters and drops it, so the checkpoint is never held twice."""
    yield from iter_safetensors(safetensors_files(path), device, readers=readers, depth=depth)


def iter_safetensors(
    files: list[Path], device="cpu", *, readers: int = _READERS, depth: int = _DEPTH, desc: str = "Loading weights"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Read `files` on up to `readers` threads; yield (name, tensor) in the order a sequential read would: file
    by file, each file's tensors in the order of their bytes. So a consumer that quantizes a layer as soon as
    its weights are in still has about one layer pending, and the files are read front to back.

    Readers claim tensors in that order within a window of `depth`: at most `depth` tensors are read and not
    yet taken by the consumer, however slow it is. A reader's exception is raised to the consumer at its next
    step, ahead of tensors already read (a safetensors error as UnsupportedModelError naming the file). Closing
    the generator early, or an exception in the consumer, stops and joins the readers.

    CPU: the tensor is a view of the file's private memory map (_Mapped: no copy); the reader faults its pages in,
    so the reads run on the reader threads, overlapped with the consumer. A consumer may keep such a view as its
    parameter (`mapped` says whether a tensor is one): its memory is then the page cache's. CUDA (see _Staging):
    pinned staging buffers, non_blocking copies on the reader's own stream; a tensor is handed over only once its
    copy has finished."""
    import torch
    from tqdm import tqdm

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    items = [(i, e) for i, f in enumerate(files) for e in _entries(f)]
    n = len(items)
    maps: dict[int, _Mapped] = {}  # CPU: one map per file, shared by the readers, opened in order
    maps_lock = threading.Lock()

    def mapped_file(fi: int) -> _Mapped:
        with maps_lock:
            if fi not in maps:
                maps[fi] = _Mapped(files[fi])
            return maps[fi]

    window = _Window(depth)
    # the consumer's stream: a reader's device tensor may reuse memory the consumer freed while this stream
    # still reads it, so each reader orders its copies after the work queued on it
    consumer_stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None

    def reader() -> None:
        fds: dict[int, int] = {}  # CUDA: this thread's own fd per file, for its preads
        staging = None
        try:
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
                staging = _Staging(dev)
            while (k := window.claim(n)) is not None:
                fi, entry = items[k]
                try:
                    if staging is None:  # CPU: a view of the file's map, faulted in here
                        t = _touch(mapped_file(fi).view(entry))
                    else:
                        if fi not in fds:
                            fds[fi] = os.open(files[fi], os.O_RDONLY)
                        t = staging.to_device(fds[fi], entry, files[fi], consumer_stream)
                    # no local keeps the tensor: once the consumer drops it, it is gone (the depth bound)
                    window.put(k, t)
                    del t
                except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
                    window.fail(files[fi], e)
                    return
        except Exception as e:  # noqa: BLE001 - staging set-up (pinned memory, stream)
            window.fail(files[0], e)
        finally:
            for fd in fds.values():
                os.close(fd)

    threads = [
        threading.Thread(target=reader, name=f"weights-reader-{r}", daemon=True) for r in range(min(max(1, readers), n))
    ]
    try:
        for th in threads:
            th.start()
        with tqdm(total=n, desc=desc, unit="tensor", disable=n < 2, leave=False) as bar:
            for k in range(n):
                t = window.take(k)
                yield items[k][1].name, t
                del t  # not held by this frame while waiting for the next one
                bar.update(1)
    finally:  # also on close() and on the consumer's exceptions
        window.stop()
        for th in threads:
            if th.ident is not None:
                th.join()
        for m in maps.values():
            m.close()  # the map itself lives on in the views a consumer kept


class _Window:
    """Claims and results shared by the readers and the consumer, under one lock: tensor k may be claimed once
    k < (tensors taken) + depth. Readers wait on `space`, the consumer on `ready`."""

    def __init__(self, depth: int):
        self.depth = max(1, depth)
        lock = threading.Lock()
        self.space, self.ready = threading.Condition(lock), threading.Condition(lock)
        self.next_claim = self.taken = 0
        self.results: dict[int, object] = {}
        self.error: tuple[Path, Exception] | None = None
        self.stopped = False

    def claim(self, n: int) -> int | None:
        with self.space:
            while not self.stopped and self.next_claim < n and self.next_claim >= self.taken + self.depth:
                self.space.wait()
            if self.stopped or self.next_claim >= n:
                return None
            self.next_claim += 1
            return self.next_claim - 1

    def put(self, k: int, t) -> None:
        with self.ready:
            if not self.stopped:
                self.results[k] = t
                if k == self.taken:  # the one the consumer waits for
                    self.ready.notify()

    def fail(self, file: Path, e: Exception) -> None:
        with self.ready:
            if self.error is None:
                self.error = (file, e)
            self._stop()

    def take(self, k: int):
        with self.ready:
            while self.error is None and k not in self.results:
                self.ready.wait()
            if self.error is not None:
                file, e = self.error
                if isinstance(e, (OSError, ValueError)):  # the file vanished, cannot be mapped, ...
                    raise UnsupportedModelError(f"cannot read weights file {file}: {e} (incomplete download?)") from e
                raise e
            self.taken = k + 1
            self.space.notify()  # one more tensor may be claimed
            return self.results.pop(k)

    def stop(self) -> None:
        with self.ready:
            self._stop()

    def _stop(self) -> None:
        self.stopped = True
        self.results.clear()
        self.space.notify_all()
        self.ready.notify_all()


@dataclass(frozen=True)
class _Entry:
    name: str
    start: int  # absolute offset of its bytes in the file
    nbytes: int
    dtype: str  # safetensors' name: BF16, F32, F8_E4M3, ...
    shape: tuple[int, ...]


def _entries(f: Path) -> list[_Entry]:
    """The tensors of a safetensors file, in file order, from its header alone; both paths rely on these checks:
    sizes match the dtypes and shapes, and the tensors cover the data exactly (as safetensors requires)."""
    try:
        with f.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        header.pop("__metadata__", None)
        out = []
        for name, m in header.items():
            begin, end = (int(x) for x in m["data_offsets"])
            out.append(_Entry(name, 8 + size + begin, end - begin, m["dtype"], tuple(int(d) for d in m["shape"])))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, MemoryError) as e:
        raise UnsupportedModelError(f"{f} is not a readable safetensors file: {type(e).__name__}: {e}") from e
    length = f.stat().st_size
    if out and max(e.start + e.nbytes for e in out) != length:  # safetensors' rule: the data is covered, no more
        raise UnsupportedModelError(
            f"{f}: its tensors end at byte {max(e.start + e.nbytes for e in out)} of {length}: incomplete download, "
            "or not a safetensors file?"
        )
    for e in out:
        count = 1
        for d in e.shape:
            count *= d
        if e.dtype not in _DTYPE_BYTES or e.nbytes != count * _DTYPE_BYTES[e.dtype] or e.start + e.nbytes > length:
            raise UnsupportedModelError(
                f"{f}: tensor {e.name!r} ({e.dtype}, shape {list(e.shape)}, {e.nbytes} bytes at {e.start}) does not "
                f"fit its dtype or the file ({length} bytes): incomplete download, or an unsupported dtype?"
            )
    return sorted(out, key=lambda e: e.start)


_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "I16": torch.int16,
        "U16": torch.uint16,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I32": torch.int32,
        "U32": torch.uint32,
        "F32": torch.float32,
        "I64": torch.int64,
        "U64": torch.uint64,
        "F64": torch.float64,
    }[name]


# ---- CPU: the files' memory maps ----------------------------------------------------------------------------
_MADV_WILLNEED = 3
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
        except OSError:  # not Linux/glibc: the reader thread's touches read the file
            pass
        with _live_lock:
            _LIVE[self.start] = self.end

    def view(self, e: _Entry) -> torch.Tensor:
        dtype = _torch_dtype(e.dtype)
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


def _touch(t: torch.Tensor) -> torch.Tensor:
    """Fault in the pages of a mapped CPU tensor on this reader thread: numpy reads one byte per page (its reduction
    releases the GIL; a torch op did the same 10-20 % slower here, and MADV_POPULATE_READ took 25 ms for SmolLM2's
    257 MiB where this takes 15: a fault maps the pages around it too). The consumer then reads memory, not the
    disk. Small tensors are left to the consumer: the call costs more than their few page faults."""
    import torch

    if t.numel() * t.element_size() < _TOUCH_MIN:
        return t
    b = t.reshape(-1).view(torch.uint8).numpy()
    int(b[::_PAGE].sum()) + int(b[-1])
    return t


class _Staging:
    """One reader's CUDA path. NOT RUN in this repo's CPU tests (no GPU here); bench/coldstart_gpu.py checks it
    against the CPU path on a GPU. Kept small on purpose:
    - two pinned buffers of _CHUNK bytes, used in turn: chunk i+1 is read (pread, GIL released) while chunk i is
      copied to the device (non_blocking, on this reader's own stream);
    - an event recorded after each copy; a buffer is refilled only after its event has completed;
    - the device tensor is handed over only after its last copy's event has completed (the stream runs in
      order, so all its chunks are on the device): the consumer may use it on any stream;
    - it is allocated on this thread's default stream, the consumer's memory pool; this stream first waits for
      the consumer's stream, whose queued work may still read the freed tensor that memory came from."""

    def __init__(self, dev):
        import torch

        self.dev = dev
        self.stream = torch.cuda.Stream(dev)
        self.bufs = [torch.empty(_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.views = [memoryview(b.numpy()) for b in self.bufs]
        self.events = [torch.cuda.Event() for _ in range(2)]
        self.turn = 0

    def to_device(self, fd: int, e: _Entry, file: Path, consumer_stream) -> torch.Tensor:
        import torch

        dst = torch.empty(e.shape, dtype=_torch_dtype(e.dtype), device=self.dev)
        out = dst.view(-1).view(torch.uint8)  # e.nbytes bytes (checked against the dtype and shape in _entries)
        self.stream.wait_stream(consumer_stream)
        last = None
        for off in range(0, e.nbytes, _CHUNK):
            k = min(_CHUNK, e.nbytes - off)
            i, self.turn = self.turn, self.turn ^ 1
            self.events[i].synchronize()  # the previous copy out of this buffer has finished
            got = 0
            while got < k:
                r = os.preadv(fd, [self.views[i][got:k]], e.start + off + got)
                if r <= 0:
                    raise UnsupportedModelError(f"{file} ends inside the data of {e.name!r} (truncated?)")
                got += r
            with torch.cuda.stream(self.stream):
                out[off : off + k].copy_(self.bufs[i][:k], non_blocking=True)
            self.events[i].record(self.stream)
            last = self.events[i]
        if last is not None:
            last.synchronize()
        return dst
