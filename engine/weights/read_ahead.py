"""The CUDA path of engine/weights/reader.py: reader threads read each tensor into pinned staging buffers and copy
it to the device, at most a window of tensors ahead of the consumer. NOT RUN on a GPU in this repo's tests: the
window runs there with CPU stand-ins for the staging (tests/test_loader.py); bench/coldstart_gpu.py checks the whole
path against the CPU path on a GPU."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from engine.errors import UnsupportedModelError
from engine.weights.header import Entry, torch_dtype

# Reader threads: up to 4, one per 4 cores. On a small box the readers only compete with the consumer's copies
# (on CPU, with 2 cores and a warm page cache, 4 readers took SmolLM2's load from 0.05 s with 1 to 0.12-0.25 s).
READERS = max(1, min(4, (os.cpu_count() or 1) // 4))
DEPTH = 8  # tensors read ahead of the consumer, at most
CHUNK = 32 << 20  # bytes per pinned staging buffer (two per reader)


def iter_cuda(
    files: list[Path], items: list[tuple[int, Entry]], dev, *, readers: int, depth: int, desc: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """reader.iter_safetensors on a CUDA device: read_ahead with a Staging per reader thread."""
    import torch

    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    # the consumer's stream: a reader's device tensor may reuse memory the consumer freed while this stream
    # still reads it, so each reader orders its copies after the work queued on it
    consumer_stream = torch.cuda.current_stream(dev)

    def cuda_reader():
        torch.cuda.set_device(dev)
        staging, fds = Staging(dev), {}  # this thread's own fd per file, for its preads

        def fetch(fi: int, e: Entry):
            if fi not in fds:
                fds[fi] = os.open(files[fi], os.O_RDONLY)
            return staging.to_device(fds[fi], e, files[fi], consumer_stream)

        return fetch, lambda: [os.close(fd) for fd in fds.values()]

    yield from read_ahead(files, items, cuda_reader, readers=readers, depth=depth, desc=desc)


def progress(n: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=n, desc=desc, unit="tensor", disable=n < 2, leave=False)


def read_ahead(
    files: list[Path], items: list[tuple[int, Entry]], open_reader, *, readers: int, depth: int, desc: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """The CUDA path's read-ahead, run on CPU stand-ins in the tests: `readers` threads each call `open_reader()`
    -> (fetch(file index, entry) -> tensor, close()) and claim tensors in file order within a window of `depth`:
    at most `depth` tensors are read and not yet taken by the consumer, however slow it is. A reader's exception
    is raised to the consumer at its next step, ahead of tensors already read (a safetensors error as
    UnsupportedModelError naming the file). Closing the generator early, or an exception in the consumer, stops
    and joins the readers."""
    n = len(items)
    window = _Window(depth)

    def reader() -> None:
        close = None
        try:
            fetch, close = open_reader()
            while (k := window.claim(n)) is not None:
                fi, entry = items[k]
                try:
                    t = fetch(fi, entry)
                    # no local keeps the tensor: once the consumer drops it, it is gone (the depth bound)
                    window.put(k, t)
                    del t
                except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
                    window.fail(files[fi], e)
                    return
        except Exception as e:  # noqa: BLE001 - the reader's set-up (pinned memory, stream)
            window.fail(files[0], e)
        finally:
            if close is not None:
                close()

    threads = [
        threading.Thread(target=reader, name=f"weights-reader-{r}", daemon=True) for r in range(min(max(1, readers), n))
    ]
    try:
        for th in threads:
            th.start()
        with progress(n, desc) as bar:
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


class Staging:
    """One reader thread's staging. Kept small on purpose:
    - two pinned buffers of CHUNK bytes, used in turn: chunk i+1 is read (pread, GIL released) while chunk i is
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
        self.bufs = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.views = [memoryview(b.numpy()) for b in self.bufs]
        self.events = [torch.cuda.Event() for _ in range(2)]
        self.turn = 0

    def to_device(self, fd: int, e: Entry, file: Path, consumer_stream) -> torch.Tensor:
        import torch

        dst = torch.empty(e.shape, dtype=torch_dtype(e.dtype), device=self.dev)
        out = dst.view(-1).view(torch.uint8)  # e.nbytes bytes (checked against the dtype and shape in header.entries)
        self.stream.wait_stream(consumer_stream)
        last = None
        for off in range(0, e.nbytes, CHUNK):
            k = min(CHUNK, e.nbytes - off)
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
