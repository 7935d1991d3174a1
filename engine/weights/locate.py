"""Where a model is: a local folder, an HF hub cache (the volume's or the image's), or the embedded default
model (converted once into the cache root). Never touches the network."""

from __future__ import annotations

import json
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import ModelNotFoundError, UnsupportedModelError

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def resolve_model_path(cfg: EngineConfig) -> Path:
    """Return the folder holding config.json and the weights. Never touches the network."""
    if cfg.model is None:
        from engine.weights.default_model import ensure_default_model  # transformers only to convert, once

        return ensure_default_model(Path(cfg.cache_root))
    local = Path(cfg.model).expanduser()
    if local.is_dir():
        return local
    searched = [str(local)]
    if cfg.model.count("/") == 1 and not cfg.model.startswith(("/", ".", "~")):
        for root in cfg.hf_cache_dirs:
            hit, tried = _find_in_hf_cache(Path(root), cfg.model, cfg.revision)
            searched += tried
            if hit is not None:
                return hit
    raise ModelNotFoundError(
        f"model {cfg.model!r} (revision {cfg.revision!r}) is not a local folder and is not in any HF cache; "
        f"no download is attempted. Searched: {', '.join(searched)}"
    )


def describe_source(cfg: EngineConfig, path: Path) -> str:
    """Which copy of the model `path` is, for the start log: Runpod's model cache on the host, another HF cache,
    a folder, or the embedded default."""
    if cfg.model is None:
        return "the embedded default model, converted in " + str(Path(cfg.cache_root))
    for root in cfg.hf_cache_dirs:
        if Path(root) in path.parents:
            kind = "Runpod's model cache" if "huggingface-cache" in Path(root).parts else "the HF cache"
            return f"{kind} {root}"
    return "the folder " + str(path)


def _find_in_hf_cache(root: Path, repo_id: str, revision: str) -> tuple[Path | None, list[str]]:
    """`<root>/models--org--name/snapshots/<rev>/`, folder name matched without regard to case
    (Runpod's model store lowercases it); `revision` is a ref name under refs/ or a commit hash."""
    want = "models--" + repo_id.replace("/", "--")
    tried = [str(root / want)]
    if not root.is_dir():
        return None, tried
    repo = next((d for d in root.iterdir() if d.name.lower() == want.lower() and d.is_dir()), None)
    if repo is None:
        return None, tried
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snap = repo / "snapshots" / commit
    tried.append(str(snap))
    if snap.is_dir():
        return snap, tried
    snaps = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
    if revision == "main" and len(snaps) == 1:  # a cache copied without refs/
        return snaps[0], tried
    return None, tried


def safetensors_files(path: Path) -> list[Path]:
    """The weight files in load order. Refuses pickle-only checkpoints (arbitrary code on load)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise UnsupportedModelError(f"{index} names shards that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise UnsupportedModelError(
            f"{path} has only pickle checkpoints ({', '.join(pickles)}). They can run arbitrary code when "
            "loaded, so only safetensors are supported: convert them (e.g. save_pretrained(..., "
            "safe_serialization=True)) and retry."
        )
    raise UnsupportedModelError(f"{path} has no *.safetensors weights")


def read_json(path: Path) -> dict:
    """A model folder's JSON file ({} when absent); a damaged one (cut short, not text) is refused naming it."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise UnsupportedModelError(f"{path} is not readable JSON ({e}): cut short by an incomplete download or copy? "
                                    "Copy it again") from None  # fmt: skip
