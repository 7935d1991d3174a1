"""Load a model's weights into a freshly built model: the checkpoint as it is, or, with QUANTIZATION=fp8, the
quantized snapshot on the volume when a valid one exists (else quantize online and write one for next time)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.weights import fp8_snapshot
from engine.weights.locate import describe_source, safetensors_files
from engine.weights.reader import iter_weights

log = logging.getLogger("engine")

# the cold-start timeline's name for each way the weights came in
PHASES = {
    "checkpoint": "weight read",
    "fp8 checkpoint": "weight read (fp8 checkpoint)",
    "fp8 snapshot": "fp8 snapshot load",
    "checkpoint, quantized online": "weight read + fp8 quantization",
}


@dataclass(frozen=True)
class LoadedWeights:
    source: str  # a key of PHASES
    files: list[Path]  # the safetensors files read
    snapshot: Path | None = None  # the fp8 snapshot used or written
    seconds: float = 0.0  # the load, model built and filled
    kept: int = 0  # bytes kept in place as parameters (views of the files' maps: CPU), and copied
    copied: int = 0

    @property
    def phase(self) -> str:
        return PHASES[self.source]

    def note(self) -> str:
        """What the timeline and the start log say: size, time, rate; on CPU, how much was kept in place."""
        size = sum(f.stat().st_size for f in self.files)
        rate = f" ({size / self.seconds / 1e9:.2f} GB/s)" if self.seconds > 0 else ""
        mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
        where = f"; {mib(self.kept)} kept in place, {mib(self.copied)} copied" if self.kept else ""
        return f"{size / 2**20:.0f} MiB read in {self.seconds:.2f} s{rate}{where}"


def load_model(
    cfg: EngineConfig,
    model_path: Path,
    prequantized: bool,
    build: Callable[[], object],
    device,
    dtype: torch.dtype,
    on_built: Callable[[], object] = lambda: None,
):
    """`_load` timed and logged: which copy of the model (locate.describe_source), how fast it was read.
    `on_built()` is called once the model is first built (the timeline's "model build" mark); the read's time, and
    its rate, count from then."""
    t0 = time.perf_counter()

    def timed_build():
        nonlocal t0, on_built
        model = build()
        if on_built is not None:  # a snapshot found bad builds again: that counts as reading
            on_built()
            on_built, t0 = None, time.perf_counter()
        return model

    model, w = _load(cfg, model_path, prequantized, timed_build, device, dtype)
    kept = getattr(model, "kept", None)
    w = replace(w, seconds=time.perf_counter() - t0, kept=kept.kept_bytes if kept else 0,
                copied=kept.copied_bytes if kept else 0)  # fmt: skip
    log.info("weights from %s: %s, %s", describe_source(cfg, model_path), w.source, w.note())
    return model, w


def _load(
    cfg: EngineConfig, model_path: Path, prequantized: bool, build: Callable[[], object], device, dtype: torch.dtype
):
    """Build the model (in `dtype`, which keys its fp8 snapshot) with `build()` and fill it. Returns (model,
    LoadedWeights). A snapshot that cannot be loaded or whose hash is wrong is never used: the model is rebuilt from
    scratch and loaded from the checkpoint, and the snapshot is rewritten."""
    files = safetensors_files(model_path)
    if prequantized or cfg.quantization != "fp8" or cfg.tensor_parallel_size > 1:  # (a snapshot is not per rank)
        model = build()
        model.load_weights(iter_weights(model_path, device))
        return model, LoadedWeights("fp8 checkpoint" if prequantized else "checkpoint", files)
    snap = fp8_snapshot.snapshot_for(cfg, model_path, str(dtype).removeprefix("torch."))
    if (model := _from_snapshot(snap, build, device)) is not None:
        return model, LoadedWeights("fp8 snapshot", [snap / fp8_snapshot.WEIGHTS], snap)
    rejected = snap.exists()
    if rejected:
        log.warning("fp8 snapshot %s is corrupt or partial: ignoring it and rebuilding", snap)
    model = build()
    model.load_weights(iter_weights(model_path, device))
    try:
        fp8_snapshot.write(snap, model.snapshot_state(), str(model_path), replace=rejected)
    except OSError as e:  # a read-only or full volume costs the next cold start, not this one
        log.warning("could not write the fp8 snapshot %s: %s", snap, e)
    return model, LoadedWeights("checkpoint, quantized online", files, snap)


def _from_snapshot(snap: Path, build: Callable[[], object], device):
    """The model loaded from a complete snapshot whose hash checks out (hashed on a thread during the load);
    None otherwise, with nothing of the snapshot left in memory."""
    manifest = fp8_snapshot.complete(snap)
    if manifest is None:
        return None
    hash_ok = fp8_snapshot.verify_in_background(snap, manifest)  # overlaps the load
    model = build()
    try:
        model.load_snapshot(fp8_snapshot.load(snap, device))
        error = None
    except Exception as e:  # noqa: BLE001 - a damaged file or header: rebuild, as for a bad hash
        error = f"{type(e).__name__}: {e}"  # not the exception: its traceback would keep the model alive
    if hash_ok() and error is None:
        log.info("fp8 weights from snapshot %s", snap)
        return model
    if error is not None:
        log.warning("fp8 snapshot %s could not be loaded: %s", snap, error)
    return None  # the caller builds a new model: nothing loaded from the snapshot is ever used
