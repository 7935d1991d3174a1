"""FP8 snapshots: written after the first online quantization, loaded on the next start (identical outputs),
and a truncated or tampered snapshot is ignored and rebuilt."""
from __future__ import annotations

import json

import torch

from engine import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 9, 33, 7, 21]}, {"prompt_token_ids": [40, 41, 42]}]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def _run(path, cache_root):
    llm = LLM(model=str(path), dtype="float32", quantization="fp8", cache_root=str(cache_root), log_stats_interval=0)
    outs = llm.generate(PROMPTS, PARAMS)
    return llm.engine.weights_source, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_snapshot_round_trip_and_corruption(tiny_models, tmp_path):
    path = tiny_models["qwen2"]  # biases and tied embeddings travel too
    src, first = _run(path, tmp_path)
    assert src == "checkpoint, quantized online"
    snaps = list((tmp_path / "fp8-snapshots").iterdir())
    assert len(snaps) == 1 and not [p for p in snaps[0].parent.iterdir() if p.name.startswith(".tmp")]
    weights = snaps[0] / "model.safetensors"
    src, second = _run(path, tmp_path)
    assert src == "fp8 snapshot" and second == first  # identical tokens and logprobs

    # truncated weights: ignored, rebuilt, and the rebuilt snapshot is used next time
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    src, third = _run(path, tmp_path)
    assert src == "checkpoint, quantized online" and third == first
    assert weights.stat().st_size == len(data)
    assert _run(path, tmp_path)[0] == "fp8 snapshot"

    # a flipped byte (same size): the hash catches it
    flipped = bytearray(weights.read_bytes())
    flipped[-100] ^= 0xFF
    weights.write_bytes(bytes(flipped))
    assert _run(path, tmp_path)[0] == "checkpoint, quantized online"

    # a manifest with a bad hash is not trusted either
    manifest = snaps[0] / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**m, "sha256": "0" * 64}))
    assert _run(path, tmp_path)[0] == "checkpoint, quantized online"


def test_snapshot_is_half_the_bytes(tiny_models, tmp_path):
    path = tiny_models["llama"]
    _run(path, tmp_path)
    snap = next((tmp_path / "fp8-snapshots").iterdir()) / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(snap), framework="pt") as f:
        assert f.get_tensor("layers.0.qkv").dtype == torch.float8_e4m3fn
        assert f.get_tensor("embed").dtype == torch.float32  # embeddings stay in the model dtype
