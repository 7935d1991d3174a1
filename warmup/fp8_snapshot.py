"""FP8 weight snapshots on the volume: quantize once, then cold-start from half the bytes.

Layout: <cache_root>/fp8-snapshots/<key>/{model.safetensors, manifest.json}. The key covers the model id,
revision, the source files (HF blob names are content hashes; else name, size and mtime) and the scheme.
Writes are atomic (temp folder + rename), so two workers starting at once cannot corrupt a snapshot. The
manifest, written last, holds the weights file's size and sha256; a snapshot whose file is missing, truncated
or does not hash to it is ignored (and rebuilt by the caller), never loaded."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from warmup.default_model import sha256_file

log = logging.getLogger(__name__)

SCHEME = "fp8-e4m3-w8a8-per-channel-v1"
_WEIGHTS, _MANIFEST = "model.safetensors", "manifest.json"


def snapshot_for(cfg, model_path: Path) -> Path:
    """This engine config's snapshot folder for the checkpoint at model_path (the engine and warmup both use it)."""
    from engine.loader import safetensors_files

    return snapshot_dir(Path(cfg.cache_root), cfg.model or "default", cfg.revision, model_path,
                        safetensors_files(model_path))


def snapshot_dir(cache_root: Path, model_id: str, revision: str, model_path: Path, files: list[Path]) -> Path:
    h = hashlib.sha256(f"{model_id}\n{revision}\n{SCHEME}\n".encode())
    for f in files:
        real = f.resolve()
        st = real.stat()
        # HF cache blobs are named by their content hash: that is the file's identity
        ident = real.name if len(real.name) == 64 and real.parent.name == "blobs" else f"{st.st_size}:{st.st_mtime_ns}"
        h.update(f"{f.name}:{ident}\n".encode())
    return cache_root / "fp8-snapshots" / h.hexdigest()[:24]


def valid(snap: Path) -> bool:
    """True only for a complete snapshot whose weights file matches its manifest."""
    try:
        manifest = json.loads((snap / _MANIFEST).read_text())
        weights = snap / _WEIGHTS
        if manifest.get("scheme") != SCHEME or weights.stat().st_size != manifest["size"]:
            return False
        return sha256_file(weights) == manifest["sha256"]
    except (OSError, ValueError, KeyError):
        return False


def load(snap: Path, device="cpu"):
    """Yield (name, tensor) from a snapshot previously checked with valid(), through the engine's parallel
    reader (straight to `device`)."""
    from engine.loader import iter_safetensors

    yield from iter_safetensors([snap / _WEIGHTS], device, desc="Loading fp8 snapshot")


def write(snap: Path, tensors: dict, source: str) -> None:
    """Atomically publish `tensors` as the snapshot at `snap` (a concurrent writer that wins is kept)."""
    from safetensors.torch import save_file

    snap.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=snap.parent))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / _WEIGHTS))
        weights = tmp / _WEIGHTS
        size = weights.stat().st_size
        (tmp / _MANIFEST).write_text(json.dumps({"scheme": SCHEME, "source": source, "size": size,
                                                 "sha256": sha256_file(weights)}))
        if snap.exists() and not valid(snap):
            shutil.rmtree(snap, ignore_errors=True)  # a corrupt one: replace it
        try:
            os.rename(tmp, snap)
            log.info("fp8 snapshot written: %s (%.0f MiB)", snap, size / 2**20)
        except OSError:
            log.info("fp8 snapshot %s was written by another worker first; keeping it", snap)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
