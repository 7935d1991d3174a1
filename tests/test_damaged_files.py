"""A corrupt or partial file on the volume, and a full disk (docs/decisions.md, "Faults"): the start fails at once
naming the file and what is wrong, or rebuilds what is ours to rebuild and says so; a full disk costs the cache,
never the start or the request, and leaves nothing half-written."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import shutil
import struct
from pathlib import Path

import pytest

from engine import EngineConfig, UnsupportedModelError
from engine.llm_engine import LLMEngine


def _cut(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _header_lies(d: Path) -> None:
    """A tensor's end offset moved past the data, the file's size unchanged."""
    f = d / "model.safetensors"
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    h = json.loads(data[8 : 8 + n])
    name = next(k for k in h if k != "__metadata__")
    h[name]["data_offsets"][1] += 4096
    head = json.dumps(h).encode()
    f.write_bytes(struct.pack("<Q", len(head)) + head + data[8 + n :])


def _missing_shard(d: Path) -> None:
    f = d / "model.safetensors"
    n = struct.unpack("<Q", f.read_bytes()[:8])[0]
    names = [k for k in json.loads(f.read_bytes()[8 : 8 + n]) if k != "__metadata__"]
    weight_map = {k: (f.name if i == 0 else "model-00002-of-00002.safetensors") for i, k in enumerate(names)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


DAMAGE = {
    "truncated shard": (lambda d: _cut(d / "model.safetensors"), "model.safetensors", "incomplete download"),
    "header that lies": (_header_lies, "model.safetensors", "does not fit"),
    "missing shard": (_missing_shard, "model-00002-of-00002.safetensors", "missing"),
    "tokenizer cut in half": (lambda d: _cut(d / "tokenizer.json"), "tokenizer.json", "not a readable tokenizer"),
    "config cut in half": (lambda d: _cut(d / "config.json"), "config.json", "not readable JSON"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_model_file_fails_the_start_naming_it(tiny_llama, tmp_path, damage):
    fn, file, why = DAMAGE[damage]
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    fn(model)
    with pytest.raises(UnsupportedModelError) as e:
        LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=16, log_stats_interval=0))
    assert file in str(e.value) and why in str(e.value), str(e.value)


def test_the_worker_reports_a_damaged_file_on_every_job(tiny_llama, tmp_path):
    """The worker still starts (a worker that dies at start is retried forever by the platform), and each job's
    error names the file: what the user sees."""
    from handler.__main__ import build_worker
    from handler.settings import load_settings

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    _cut(model / "tokenizer.json")
    worker = build_worker(settings=load_settings({"MODEL_NAME": str(model), "DTYPE": "float32"}))

    async def job():
        return [c async for c in worker.handle({"id": "j", "input": {"prompt": "hi"}})]

    [chunk] = asyncio.run(job())
    assert "tokenizer.json" in chunk["error"] and "not a readable tokenizer" in chunk["error"]


def test_a_damaged_converted_default_model_is_converted_again(tmp_path, monkeypatch, caplog):
    """The default model is ours to rebuild: a file of the converted folder cut short is seen at the next start
    (its size against the one the conversion recorded) and the conversion runs again."""
    from engine.weights import default_model

    runs = []

    def convert(src, dst):
        runs.append(dst)
        (dst / "model.safetensors").write_bytes(b"w" * 1000)
        (dst / "config.json").write_text("{}")

    monkeypatch.setattr(default_model, "_convert", convert)
    monkeypatch.setattr(default_model, "_gguf_sha256", lambda src, root, remember: "0" * 64)
    out = default_model.ensure_default_model(tmp_path)
    assert default_model.ensure_default_model(tmp_path) == out and len(runs) == 1  # whole: not converted again
    _cut(out / "model.safetensors")
    with caplog.at_level(logging.WARNING, "engine"):
        assert default_model.ensure_default_model(tmp_path) == out
    assert len(runs) == 2 and (out / "model.safetensors").stat().st_size == 1000
    assert "damaged (model.safetensors: 500 bytes, 1000 written)" in caplog.text


def test_a_full_disk_costs_the_fp8_snapshot_not_the_start(tiny_llama, tmp_path, monkeypatch, caplog):
    from engine.weights import layout

    def full(path, tensors):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(layout, "write", full)
    cfg = EngineConfig(model=str(tiny_llama), quantization="fp8", num_kv_blocks=16, cache_root=str(tmp_path))
    with caplog.at_level(logging.WARNING, "engine"):
        eng = LLMEngine(cfg)
    assert eng.weights_source == "checkpoint, quantized online"
    assert "could not write the fp8 snapshot" in caplog.text and "No space left" in caplog.text
    assert not [p for p in (tmp_path / "fp8-snapshots").rglob("*") if p.is_file()]  # nothing half-written stays


def test_a_triton_cache_on_a_full_disk_moves_to_the_container(tmp_path, monkeypatch, caplog):
    from handler import settings

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(settings, "_free_bytes", lambda path: 10 << 20)
    with caplog.at_level(logging.WARNING, "handler"):
        settings.set_library_defaults()
    import os

    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "home" / ".triton" / "cache")
    assert "is on a disk with 10 MiB free" in caplog.text
