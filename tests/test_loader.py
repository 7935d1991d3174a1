"""engine.weights.iter_weights over a sharded safetensors checkpoint: the CPU path (views of the files' maps, one
fault-in thread) for real; the CUDA path's read-ahead (reader threads, a bounded window) and its staging chunk loop
with CPU stand-ins for what only a GPU has. bench/coldstart_gpu.py checks the CUDA path for real against the CPU
path on a GPU."""

from __future__ import annotations

import json
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.errors import UnsupportedModelError
from engine.weights import header, iter_weights, read_ahead, safetensors_files
from engine.weights import reader as loader


def _shards() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [
        {"a.w": r(64, 33).bfloat16(), "a.b": r(7), "a.scalar": torch.tensor(3.5), "a.empty": torch.zeros(0, 4).half()},
        {
            "b.fp8": r(16, 16).clamp(-400, 400).to(torch.float8_e4m3fn),
            "b.i64": torch.arange(5) * 7,
            "b.big": r(300, 257).bfloat16(),
            "b.mask": torch.rand(9, generator=g) > 0.5,
        },
        {f"c.{i:02d}": r(3, 50 + i) for i in range(40)},
    ]


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """Three shards and model.safetensors.index.json, as HF writes them."""
    weight_map = {}
    for i, tensors in enumerate(_shards()):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(tensors, str(tmp_path / name))
        weight_map |= {k: name for k in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


def _sequential(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, for any dtype (fp8 and bool included), shape and dtype too."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _readers_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("weights-reader-", "weights-fault-in"))]


def _stand_in_reader(files: list[Path], fetched: list | None = None):
    """_read_ahead's open_reader for CPU: each tensor read from the file with its own pread (the CUDA reader's
    staging, without the device). `fetched`: every (file index, entry) fetched, in order."""
    import os

    def open_reader():
        fds = {}

        def fetch(fi, e):
            if fi not in fds:
                fds[fi] = os.open(files[fi], os.O_RDONLY)
            t = torch.empty(e.shape, dtype=header.torch_dtype(e.dtype))
            if e.nbytes:
                t.reshape(-1).view(torch.uint8).numpy()[:] = list(os.pread(fds[fi], e.nbytes, e.start))
            if fetched is not None:
                fetched.append((fi, e))
            return t

        return fetch, lambda: [os.close(fd) for fd in fds.values()]

    return open_reader


def _read_ahead(ckpt: Path, fetched: list | None = None, **kw):
    files = safetensors_files(ckpt)
    items = [(i, e) for i, f in enumerate(files) for e in header.entries(f)]
    return read_ahead.read_ahead(files, items, _stand_in_reader(files, fetched), desc="test", **kw)


def test_cpu_read_yields_what_a_sequential_read_does(ckpt):
    ref = _sequential(ckpt)
    got = list(iter_weights(ckpt))
    names = [n for n, _ in got]
    assert len(names) == len(set(names)) and set(names) == set(ref)
    assert all(_same(t, ref[n]) for n, t in got)  # after the generator ended: its maps are closed, tensors live
    assert all(loader.mapped(t) is False for _, t in got)  # no longer handed out
    # file by file, as a sequential read: shard 1's tensors, then shard 2's, then shard 3's
    shard = {n: int(n[0] == "b") + 2 * int(n[0] == "c") for n in names}
    assert [shard[n] for n in names] == sorted(shard[n] for n in names)
    assert not _readers_alive()


def test_cpu_read_faults_every_page_in_before_it_ends(ckpt, monkeypatch):
    """The fault-in thread covers each file whole, in chunks, front to back, and the generator ends only after it
    has: the load's time includes the whole read. Without MADV_POPULATE_READ (an older kernel), pages are read."""
    calls = []
    real = loader.madvise

    def spy(spans, advice):
        if advice == loader._MADV_POPULATE_READ:
            time.sleep(0.01)  # slower than the consumer: the generator must wait for it
            calls.extend(spans)
            return 22 if "no_populate" in request_kind else real(spans, advice)
        return real(spans, advice)

    touched = []
    real_touch = loader._touch
    monkeypatch.setattr(loader, "madvise", spy)
    monkeypatch.setattr(loader, "_touch", lambda b: (touched.append(b.numel()), real_touch(b)))
    monkeypatch.setattr(loader, "_FAULT_CHUNK", 8192)
    sizes = [f.stat().st_size for f in safetensors_files(ckpt)]
    for request_kind in ("populate", "no_populate"):
        calls.clear(), touched.clear()
        assert len(list(iter_weights(ckpt))) == 48
        if request_kind == "populate":
            assert sum(n for _, n in calls) == sum(sizes) and not touched
            assert all(n <= 8192 for _, n in calls) and len(calls) > len(sizes)
        else:  # the first call fails; from then on every chunk is touched instead
            assert len(calls) == 1 and sum(touched) == sum(sizes)


def test_read_ahead_yields_what_a_sequential_read_does(ckpt):
    ref = _sequential(ckpt)
    got = list(_read_ahead(ckpt, readers=4, depth=3))
    assert [n for n, _ in got] == [n for n, _ in iter_weights(ckpt)]  # the same order as the CPU path
    assert all(_same(t, ref[n]) for n, t in got)
    assert not _readers_alive()
    assert [n for n, _ in _read_ahead(ckpt, readers=1, depth=1)] == [n for n, _ in got]


def test_truncated_shard_is_a_clear_error(ckpt):
    shard = ckpt / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])  # header intact, tensor data cut short: found from the header
    with pytest.raises(UnsupportedModelError, match="model-00002-of-00003.safetensors.*incomplete download"):
        for _ in iter_weights(ckpt):
            pass
    assert not _readers_alive()
    shard.write_bytes(data[:5])  # not even a header
    with pytest.raises(UnsupportedModelError, match="model-00002-of-00003.safetensors"):
        list(iter_weights(ckpt))


def test_bad_shard_found_by_a_reader_is_a_clear_error(ckpt):
    # trailing bytes: every tensor fits the file, but the data is not covered exactly (safetensors refuses it
    # too); the consumer gets that error, naming the file, before any tensor of the bad shard
    shard = ckpt / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes() + b"\0" * 64)
    got = []
    with pytest.raises(UnsupportedModelError, match="model-00002-of-00003.safetensors"):
        for name, _ in iter_weights(ckpt):
            got.append(name)
    assert not any(n.startswith(("b.", "c.")) for n in got)
    assert not _readers_alive()


def test_header_entries_match_safetensors(ckpt):
    """The CUDA path allocates from the header alone (dtype, shape, offsets): check them on every dtype here."""
    for f in safetensors_files(ckpt):
        data = f.read_bytes()
        with safe_open(str(f), framework="pt") as h:
            for e in header.entries(f):
                t = h.get_tensor(e.name)
                assert header.torch_dtype(e.dtype) == t.dtype and e.shape == tuple(t.shape)
                assert data[e.start : e.start + e.nbytes] == t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_reader_error_reaches_the_consumer_before_tensors_already_read(ckpt):
    took_one, failed = threading.Event(), threading.Event()
    files = safetensors_files(ckpt)
    items = [(i, e) for i, f in enumerate(files) for e in header.entries(f)]
    stand_in = _stand_in_reader(files)

    def open_reader():
        fetch, close = stand_in()

        def flaky(fi, e):
            if e.name == "b.big":  # in the second shard: fails once the consumer has a tensor
                took_one.wait(10)
                failed.set()
                raise RuntimeError("disk on fire")
            return fetch(fi, e)

        return flaky, close

    gen = read_ahead.read_ahead(files, items, open_reader, readers=2, depth=100, desc="test")  # all may be read ahead
    next(gen)
    took_one.set()
    assert failed.wait(10)
    time.sleep(0.2)  # the other reader has read tensors before b.big by now; the error still comes first
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(gen)
    assert not _readers_alive()


def test_a_reader_that_cannot_start_is_an_error_naming_the_file(ckpt):
    files = safetensors_files(ckpt)
    items = [(i, e) for i, f in enumerate(files) for e in header.entries(f)]

    def broken():
        raise RuntimeError("no pinned memory")

    with pytest.raises(RuntimeError, match="no pinned memory"):
        list(read_ahead.read_ahead(files, items, broken, readers=2, depth=4, desc="test"))
    assert not _readers_alive()


def test_closing_early_stops_the_threads(ckpt):
    gen = _read_ahead(ckpt, readers=4, depth=2)
    next(gen), next(gen)
    assert len(_readers_alive()) == 4
    gen.close()
    assert not _readers_alive()
    for _ in _read_ahead(ckpt, readers=3, depth=2):  # break out of a loop: the generator is closed when dropped
        break
    assert not _readers_alive()
    gen = iter_weights(ckpt)  # the CPU path's fault-in thread
    next(gen)
    gen.close()
    assert not _readers_alive()
    with pytest.raises(ZeroDivisionError):
        for _ in iter_weights(ckpt):
            1 / 0  # noqa: B018 - the consumer fails
    assert not _readers_alive()


def test_read_ahead_is_bounded_by_depth(ckpt):
    lock, alive, peak = threading.Lock(), [0], [0]
    files = safetensors_files(ckpt)
    items = [(i, e) for i, f in enumerate(files) for e in header.entries(f)]
    stand_in = _stand_in_reader(files)

    def open_reader():
        fetch, close = stand_in()

        def counted(fi, e):
            t = fetch(fi, e)
            with lock:
                alive[0] += 1
                peak[0] = max(peak[0], alive[0])

            def gone():
                with lock:
                    alive[0] -= 1

            weakref.finalize(t, gone)
            return t

        return counted, close

    n = 0
    for _, t in read_ahead.read_ahead(files, items, open_reader, readers=4, depth=5, desc="test"):  # noqa: B007
        time.sleep(0.003)  # a slow consumer, holding each tensor
        n += 1
    del t
    assert n == 48
    # at most `depth` tensors read ahead, plus the one the consumer holds; and the readers did run ahead
    assert 5 <= peak[0] <= 6, peak[0]
    assert alive[0] == 0


def test_cuda_staging_loop_with_cpu_stand_ins(ckpt, monkeypatch):
    """_Staging.to_device's chunking (offsets, buffer turns, multi-chunk, 0-d and empty tensors, a short file)
    with CPU stand-ins for the pinned buffers, stream and events; what only a GPU can check (the asynchronous
    ordering) is left to bench/coldstart_gpu.py."""
    import contextlib
    import os

    class Sync:  # stream / event stand-in: records the calls
        def __init__(self):
            self.calls = []

        def wait_stream(self, s):
            self.calls.append("wait")

        def record(self, s):
            self.calls.append("record")

        def synchronize(self):
            self.calls.append("sync")

    monkeypatch.setattr(read_ahead, "CHUNK", 1000)  # tensors of up to 154 KB: many chunks
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    st = object.__new__(read_ahead.Staging)
    st.dev, st.stream, st.turn = torch.device("cpu"), Sync(), 0
    st.bufs = [torch.empty(1000, dtype=torch.uint8) for _ in range(2)]
    st.views = [memoryview(b.numpy()) for b in st.bufs]
    st.events = [Sync(), Sync()]
    for f in safetensors_files(ckpt):
        fd = os.open(f, os.O_RDONLY)
        try:
            with safe_open(str(f), framework="pt") as h:
                for e in header.entries(f):
                    assert _same(st.to_device(fd, e, f, Sync()), h.get_tensor(e.name)), e.name
        finally:
            os.close(fd)
    # a buffer is refilled (then its copy recorded) only after a sync on its event since its last record
    for ev in st.events:
        synced = False
        for call in ev.calls:
            assert call == "sync" or synced, ev.calls
            synced = call == "sync"
    # the two buffers take turns
    assert abs(st.events[0].calls.count("record") - st.events[1].calls.count("record")) <= 1
    assert st.events[0].calls.count("record") > 100
    shard = ckpt / "model-00002-of-00003.safetensors"
    big = next(e for e in header.entries(shard) if e.name == "b.big")
    fd = os.open(shard, os.O_RDONLY)
    os.truncate(shard, big.start + 10)  # the file shrinks after its header was read
    try:
        with pytest.raises(UnsupportedModelError, match="ends inside the data of 'b.big'"):
            st.to_device(fd, big, shard, Sync())
    finally:
        os.close(fd)
