"""FP8 weight snapshots on the volume: quantize once, then cold-start from half the bytes.

Layout: <cache_root>/fp8-snapshots/<key>/{model.safetensors, manifest.json}. The key covers the model id,
revision, the source files (HF blob names are content hashes; else name, size and mtime) and the scheme.
Writes are atomic (temp folder + rename), so two workers starting at once cannot corrupt a snapshot. The
manifest, written last, holds the weights file's size and a SHA-256 per 64 MiB piece; a snapshot whose file is
missing, truncated or does not hash to them is ignored (and rebuilt by the caller), never used. The engine hashes
the file while it loads it (verify_in_background), the pieces on every core at once: one SHA-256 runs at about
1 GB/s on one core, so a whole-file digest was the fp8 snapshot's whole load time on an H200 host (3.54 s of 3.56
s for 3.85 GB, docs/gpu.md). A snapshot that fails the check is dropped before the model ever runs; one written
before the pieces (a single "sha256") is still checked, on one core."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.weights.default_model import sha256_file
from engine.weights.locate import safetensors_files
from engine.weights.reader import iter_safetensors

log = logging.getLogger(__name__)

SCHEME = "fp8-e4m3-w8a8-per-channel-v1"
WEIGHTS, _MANIFEST = "model.safetensors", "manifest.json"
PIECE = 64 << 20  # bytes per digest: pieces for every core, the default model's ~170 MB snapshot too


def snapshot_for(cfg, model_path: Path, dtype: str) -> Path:
    """This engine config's snapshot folder for the checkpoint at model_path and the model dtype (the engine and
    warmup both use it). The dtype is in the key: the 16-bit tensors (embeddings, norms, lm_head) are stored in it,
    so an fp32 engine must not load what a bf16 one wrote."""
    files = safetensors_files(model_path)
    return snapshot_dir(Path(cfg.cache_root), cfg.model or "default", cfg.revision, model_path, files, dtype)


def snapshot_dir(
    cache_root: Path, model_id: str, revision: str, model_path: Path, files: list[Path], dtype: str
) -> Path:
    h = hashlib.sha256(f"{model_id}\n{revision}\n{SCHEME}\n{dtype}\n".encode())
    for f in files:
        real = f.resolve()
        st = real.stat()
        # HF cache blobs are named by their content hash: that is the file's identity
        ident = real.name if len(real.name) == 64 and real.parent.name == "blobs" else f"{st.st_size}:{st.st_mtime_ns}"
        h.update(f"{f.name}:{ident}\n".encode())
    return cache_root / "fp8-snapshots" / h.hexdigest()[:24]


def complete(snap: Path) -> dict | None:
    """The manifest of a snapshot that is complete (manifest present, our scheme, weights of the right size);
    None otherwise. Cheap: the contents are checked by valid() or verify_in_background()."""
    try:
        manifest = json.loads((snap / _MANIFEST).read_text())
        if manifest.get("scheme") != SCHEME or (snap / WEIGHTS).stat().st_size != manifest["size"]:
            return None
        pieces = isinstance(manifest.get("sha256_pieces"), list) and int(manifest.get("piece_bytes", 0)) > 0
        return manifest if pieces or isinstance(manifest.get("sha256"), str) else None
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None


def hash_threads() -> int:
    """The cores this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def piece_hashes(path: Path, piece: int) -> list[str]:
    """The SHA-256 of each `piece` bytes of the file, on a thread per core (hashlib and reads release the GIL)."""
    starts = range(0, max(path.stat().st_size, 1), piece)
    with ThreadPoolExecutor(min(hash_threads(), len(starts))) as pool:
        return list(pool.map(lambda start: sha256_file(path, start, piece), starts))


def _hash_matches(snap: Path, manifest: dict) -> bool:
    try:
        if "sha256_pieces" in manifest:
            return piece_hashes(snap / WEIGHTS, int(manifest["piece_bytes"])) == manifest["sha256_pieces"]
        return sha256_file(snap / WEIGHTS) == manifest["sha256"]  # written before the pieces: one core
    except OSError:
        return False


def valid(snap: Path) -> bool:
    """True only for a complete snapshot whose weights file matches its manifest."""
    manifest = complete(snap)
    return manifest is not None and _hash_matches(snap, manifest)


def verify_in_background(snap: Path, manifest: dict) -> Callable[[], bool]:
    """Start hashing the snapshot's weights (piece_hashes) beside the load; returns a function that waits for the
    verdict."""
    verdict: list[bool] = []
    th = threading.Thread(
        target=lambda: verdict.append(_hash_matches(snap, manifest)), name="fp8-snapshot-sha256", daemon=True
    )
    th.start()

    def result() -> bool:
        th.join()
        return bool(verdict and verdict[0])

    return result


def load(snap: Path, device="cpu"):
    """Yield (name, tensor) from a complete snapshot through the engine's parallel reader (straight to
    `device`). Use nothing loaded from it before valid() or verify_in_background() says yes."""
    yield from iter_safetensors([snap / WEIGHTS], device, desc="Loading fp8 snapshot")


def write(snap: Path, tensors: dict, source: str, replace: bool = False) -> None:
    """Atomically publish `tensors` as the snapshot at `snap` (a concurrent writer that wins is kept).
    replace: the caller could not use the snapshot there (even one whose hash matches: a damaged header)."""
    from engine.weights import layout

    snap.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=snap.parent))
    try:
        layout.write(tmp / WEIGHTS, tensors.items())  # aligned: a CPU engine keeps its tensors as they are
        weights = tmp / WEIGHTS
        size = weights.stat().st_size
        (tmp / _MANIFEST).write_text(
            json.dumps(
                {
                    "scheme": SCHEME,
                    "source": source,
                    "size": size,
                    "piece_bytes": PIECE,
                    "sha256_pieces": piece_hashes(weights, PIECE),
                }
            )  # fmt: skip
        )
        if snap.exists() and (replace or not valid(snap)):
            shutil.rmtree(snap, ignore_errors=True)  # a corrupt one: replace it
        try:
            os.rename(tmp, snap)
            log.info("fp8 snapshot written: %s (%.0f MiB)", snap, size / 2**20)
        except OSError:
            log.info("fp8 snapshot %s was written by another worker first; keeping it", snap)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
