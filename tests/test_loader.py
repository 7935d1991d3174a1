"""engine.weights.iter_weights: parallel reader threads over a sharded safetensors checkpoint (CPU path).

The CUDA path (pinned staging buffers, per-reader streams) cannot run here: its chunk loop runs below with CPU
stand-ins, and bench/coldstart_gpu.py checks it for real against the CPU path on a GPU."""

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
from engine.weights import iter_weights, safetensors_files
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
    return [t.name for t in threading.enumerate() if t.name.startswith("weights-reader-")]


def test_parallel_read_yields_what_a_sequential_read_does(ckpt):
    ref = _sequential(ckpt)
    got = list(iter_weights(ckpt, readers=4, depth=3))
    names = [n for n, _ in got]
    assert len(names) == len(set(names)) and set(names) == set(ref)
    assert all(_same(t, ref[n]) for n, t in got)  # after the generator ended: its handles are gone, tensors live
    # file by file, as a sequential read: shard 1's tensors, then shard 2's, then shard 3's
    shard = {n: int(n[0] == "b") + 2 * int(n[0] == "c") for n in names}
    assert [shard[n] for n in names] == sorted(shard[n] for n in names)
    assert not _readers_alive()
    # one reader and depth 1 give the same
    assert [n for n, _ in iter_weights(ckpt, readers=1, depth=1)] == names


def test_truncated_shard_is_a_clear_error(ckpt):
    shard = ckpt / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])  # header intact, tensor data cut short: found from the header
    with pytest.raises(UnsupportedModelError, match="model-00002-of-00003.safetensors.*incomplete download"):
        for _ in iter_weights(ckpt, readers=3, depth=2):
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
        for name, _ in iter_weights(ckpt, readers=3, depth=2):
            got.append(name)
    assert not any(n.startswith(("b.", "c.")) for n in got)
    assert not _readers_alive()


def test_header_entries_match_safetensors(ckpt):
    """The CUDA path allocates from the header alone (dtype, shape, offsets): check them on every dtype here."""
    for f in safetensors_files(ckpt):
        data = f.read_bytes()
        with safe_open(str(f), framework="pt") as h:
            for e in loader._entries(f):
                t = h.get_tensor(e.name)
                assert loader._torch_dtype(e.dtype) == t.dtype and e.shape == tuple(t.shape)
                assert data[e.start : e.start + e.nbytes] == t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_reader_error_reaches_the_consumer_before_tensors_already_read(ckpt, monkeypatch):
    took_one, failed = threading.Event(), threading.Event()
    touch = loader._touch

    def flaky(t):
        if t.shape == (300, 257):  # b.big, in the second shard: fails once the consumer has a tensor
            took_one.wait(10)
            failed.set()
            raise RuntimeError("disk on fire")
        return touch(t)

    monkeypatch.setattr(loader, "_touch", flaky)
    gen = iter_weights(ckpt, readers=2, depth=100)  # everything may be read ahead
    next(gen)
    took_one.set()
    assert failed.wait(10)
    time.sleep(0.2)  # the other reader has read tensors before b.big by now; the error still comes first
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(gen)
    assert not _readers_alive()


def test_closing_early_stops_the_readers(ckpt):
    gen = iter_weights(ckpt, readers=4, depth=2)
    next(gen), next(gen)
    assert len(_readers_alive()) == 4
    gen.close()
    assert not _readers_alive()
    for _ in iter_weights(ckpt, readers=3):  # break out of a loop: the generator is closed when dropped
        break
    assert not _readers_alive()


def test_read_ahead_is_bounded_by_depth(ckpt, monkeypatch):
    lock, alive, peak = threading.Lock(), [0], [0]
    touch = loader._touch

    def counted(t):
        t = touch(t)
        with lock:
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])

        def gone():
            with lock:
                alive[0] -= 1

        weakref.finalize(t, gone)
        return t

    monkeypatch.setattr(loader, "_touch", counted)
    n = 0
    for _, t in iter_weights(ckpt, readers=4, depth=5):  # noqa: B007 - a slow consumer, holding each tensor
        time.sleep(0.003)
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

    monkeypatch.setattr(loader, "_CHUNK", 1000)  # tensors of up to 154 KB: many chunks
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    st = object.__new__(loader._Staging)
    st.dev, st.stream, st.turn = torch.device("cpu"), Sync(), 0
    st.bufs = [torch.empty(1000, dtype=torch.uint8) for _ in range(2)]
    st.views = [memoryview(b.numpy()) for b in st.bufs]
    st.events = [Sync(), Sync()]
    for f in safetensors_files(ckpt):
        fd = os.open(f, os.O_RDONLY)
        try:
            with safe_open(str(f), framework="pt") as h:
                for e in loader._entries(f):
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
    big = next(e for e in loader._entries(shard) if e.name == "b.big")
    fd = os.open(shard, os.O_RDONLY)
    os.truncate(shard, big.start + 10)  # the file shrinks after its header was read
    try:
        with pytest.raises(UnsupportedModelError, match="ends inside the data of 'b.big'"):
            st.to_device(fd, big, shard, Sync())
    finally:
        os.close(fd)
