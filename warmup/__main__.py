"""`python -m warmup [--model NAME] [--revision REV] [--check]`: prepare a worker, a volume or an image.

Settings come from the environment through handler.settings (the only env reader), as the worker reads them,
so a volume prepared here is the one the worker looks for. Steps, each timed: resolve the model in the HF
caches (download it when missing and a network is plausible), convert the default model, check the
checkpoint (and that the worker's transformers-free tokenizer agrees with transformers' on it), build the fp8
snapshot (QUANTIZATION=fp8), compile the Triton kernels the worker will need (CUDA only).

--check writes nothing and uses no network: it says what is missing. Exit codes: 0 ready, 1 not ready or
failed, 2 bad settings. User errors are one line on stderr, never a traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger("warmup")

# What the engine reads: weights (safetensors only: pickles run code on load), configs, tokenizer files.
ALLOW_PATTERNS = [
    "*.safetensors",
    "*.json",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",
]
WARMUP_KV_BLOCKS = 64  # enough for the warmup request; a multiple of 16 keeps Triton's stride specialization


class NotReady(Exception):
    """A missing or unusable piece; the message is the one line the user sees."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m warmup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="overrides MODEL_NAME (empty: the embedded default model)")
    ap.add_argument("--revision", help="overrides MODEL_REVISION")
    ap.add_argument("--check", action="store_true", help="verify the volume is ready; no network, no writes")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    from engine import EngineError, Timeline  # torch: the bulk of the start-up time, so timed
    from handler.settings import SettingsError, load_settings

    tl = Timeline(start=t0)
    tl.mark("imports")
    update = {"MODEL_REVISION": args.revision} if args.revision else {}
    if args.model is not None:
        update["MODEL_NAME"] = args.model.strip() or None  # empty means unset, as in the environment
    try:
        with tl.phase("settings"):
            settings = load_settings().model_copy(update=update)
            cfg = settings.engine_config()
    except SettingsError as e:
        print(f"warmup: invalid settings: {e}", file=sys.stderr)
        return 2
    try:
        return check(cfg) if args.check else prepare(settings, cfg, tl)
    except (NotReady, EngineError, OSError) as e:
        print(f"warmup: failed: {_one_line(e)}", file=sys.stderr)
        return 1


def check(cfg) -> int:
    from engine import weights

    missing, path = [], None
    try:
        if cfg.model is None:  # resolve_model_path would convert it: look without writing
            d, path = weights.converted_dir(Path(cfg.cache_root))
            if path is None:
                missing.append(f"the default model is not converted yet (expected {d})")
        else:
            path = weights.resolve_model_path(cfg)
    except Exception as e:  # noqa: BLE001 - ModelNotFoundError, or a package/file problem: all "missing"
        missing.append(_one_line(e))
    if path is not None:
        spec = _check_model(path)
        _check_tokenizer(cfg, path)
        snap = _snapshot(cfg, path, spec)
        if snap is not None and not weights.snapshot_valid(snap):
            missing.append(f"QUANTIZATION=fp8: no valid fp8 snapshot at {snap}")
        _summary(cfg, path, snap)
    elif cfg.quantization == "fp8":
        missing.append("QUANTIZATION=fp8: the fp8 snapshot cannot be checked until the model is present")
    for m in missing:
        print(f"missing: {m}")
    print("not ready" if missing else "ready")
    return 1 if missing else 0


def prepare(settings, cfg, tl) -> int:
    from engine import ModelNotFoundError, weights

    if cfg.model is None:
        with tl.phase("default model conversion"):
            path = weights.resolve_model_path(cfg)  # converts once into the cache root
    else:
        try:
            with tl.phase("model resolution"):
                path = weights.resolve_model_path(cfg)
        except ModelNotFoundError as e:
            _may_download(settings, cfg, e)
            with tl.phase("download"):
                _download(settings, cfg)
            path = weights.resolve_model_path(cfg)
    with tl.phase("model check"):
        spec = _check_model(path)
        _check_tokenizer(cfg, path)
    snap = _snapshot(cfg, path, spec)
    need_snapshot = snap is not None and not weights.snapshot_valid(snap)

    import torch

    engine = None
    if need_snapshot or torch.cuda.is_available():
        from engine import LLMEngine

        with tl.phase("engine build") as p:
            # A small KV pool: warmup needs one short request, not the worker's full budget
            engine = LLMEngine(cfg.replace(num_kv_blocks=WARMUP_KV_BLOCKS, max_model_len=None, log_stats_interval=0))
            p.note = f"weights: {engine.weights_source}"
        if need_snapshot and not weights.snapshot_valid(snap):  # the engine only warns when it cannot write it
            raise NotReady(f"the fp8 snapshot could not be written to {snap} (see the log above)")
    else:
        tl.skip("engine build", "no fp8 snapshot to build and no CUDA")
    if not torch.cuda.is_available():
        tl.skip("kernel warmup", "no CUDA: Triton kernels compile on first use on the GPU (into TRITON_CACHE_DIR)")
    elif engine.kernel_backend != "triton":  # KERNEL_BACKEND=torch
        tl.skip("kernel warmup", f"kernel backend is {engine.kernel_backend}")
    else:
        with tl.phase("kernel warmup") as p:
            p.note = _warm_kernels(engine)  # into TRITON_CACHE_DIR, which the worker reads
    print(tl.table())
    _summary(cfg, path, snap)
    print("ready")
    return 0


def _may_download(settings, cfg, err: Exception) -> None:
    """Raise unless a download can work: an HF repo id and no offline mode."""
    if cfg.model.count("/") != 1 or cfg.model.startswith(("/", ".", "~")):
        raise NotReady(_one_line(err))  # a local path: nothing to download
    if settings.HF_HUB_OFFLINE:
        raise NotReady(f"{_one_line(err)} HF_HUB_OFFLINE=1, so warmup does not download it either.")


def _download(settings, cfg) -> None:
    from huggingface_hub import snapshot_download

    target = _first_writable(settings.hf_cache_dirs())
    log.info("downloading %s@%s into %s", cfg.model, cfg.revision, target)
    try:
        token = settings.HF_TOKEN.get_secret_value() if settings.HF_TOKEN else None  # the image's build secret
        snapshot_download(
            cfg.model, revision=cfg.revision, cache_dir=str(target), allow_patterns=ALLOW_PATTERNS, token=token
        )
    except Exception as e:  # noqa: BLE001 - gated, not found, no network: one line, not a hub traceback
        raise NotReady(
            f"download of {cfg.model}@{cfg.revision} into {target} failed: {type(e).__name__}: {_one_line(e)}"
        ) from e


def _first_writable(dirs) -> Path:
    for d in map(Path, dirs):
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return d
    raise NotReady(f"no writable HF cache directory among {', '.join(dirs)}")


def _check_model(path: Path):
    """Cheap proof that the engine can load it: safetensors present, a supported config (no weights read)."""
    from engine import ModelSpec, weights

    weights.safetensors_files(path)
    return ModelSpec.from_hf(weights.read_json(path / "config.json"))


def _check_tokenizer(cfg, path: Path) -> None:
    """The worker encodes and renders chat templates without transformers; say where that would differ from
    transformers for this model (here, where loading transformers costs no request anything)."""
    from engine import Tokenizer, compare_with_transformers

    for diff in compare_with_transformers(Tokenizer(cfg.tokenizer or path)):
        print(f"warning: tokenizer: {diff}")


def _snapshot(cfg, path: Path, spec) -> Path | None:
    """Where the engine keeps this model's fp8 snapshot, or None when it uses none."""
    if cfg.quantization != "fp8" or spec.prequantized or cfg.tensor_parallel_size > 1:  # (none per rank)
        return None
    import torch

    from engine import model_dtype, weights

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where this warmup's engine, and the worker, run
    dtype = model_dtype(cfg.dtype, weights.read_json(path / "config.json"), device)
    return weights.snapshot_for(cfg, path, str(dtype).removeprefix("torch."))  # the engine's own key


def _warm_kernels(engine) -> str:
    """Every Triton variant this config's worker can ask for: one short request (a prefill and a decode step),
    then, drained now, the work the worker does after ready (engine.idle: the padding-only warm steps, LoRA's when
    it is on, the grammar masks, which a worker warms once its first grammar exists, and the CUDA graph captures)."""
    from engine import SamplingParams

    engine.add_request("warmup", "Warm up the kernels.", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.idle.warm_grammar()
    engine.idle.drain()
    return f"one request, then {engine.idle.pieces} warm-up pieces"


def _summary(cfg, path: Path, snap: Path | None) -> None:
    from engine import weights

    files = weights.safetensors_files(path)
    print(f"model: {cfg.model or 'default (SmolLM2-135M-Instruct)'} @ {cfg.revision}")
    print(f"path: {path} ({sum(f.stat().st_size for f in files):,} bytes in {len(files)} safetensors file(s))")
    if snap is not None:
        size = (snap / "model.safetensors").stat().st_size if (snap / "model.safetensors").is_file() else 0
        print(f"fp8 snapshot: {snap} ({size:,} bytes)")


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
