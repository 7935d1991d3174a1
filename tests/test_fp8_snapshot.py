"""FP8 snapshots: written after the first online quantization, loaded on the next start (identical outputs),
and a truncated or tampered snapshot is ignored and rebuilt."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.weights import fp8_snapshot

pytestmark = pytest.mark.slow  # fp8 snapshots written and read back

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
    # the engine loads while it hashes: the tampered tensors were read, and must not have been used
    assert _run(path, tmp_path) == ("checkpoint, quantized online", first)

    # a manifest with a bad hash is not trusted either
    manifest = snaps[0] / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**m, "sha256_pieces": ["0" * 64] * len(m["sha256_pieces"])}))
    assert _run(path, tmp_path) == ("checkpoint, quantized online", first)

    # a damaged header (right size, and a manifest that vouches for it): the load fails, the engine rebuilds
    bad = b"\xff" * 16 + weights.read_bytes()[16:]
    weights.write_bytes(bad)
    manifest.write_text(json.dumps({**m, "sha256_pieces": fp8_snapshot.piece_hashes(weights, m["piece_bytes"])}))
    assert _run(path, tmp_path) == ("checkpoint, quantized online", first)
    assert _run(path, tmp_path) == ("fp8 snapshot", first)


def test_pieces_hash_apart_and_a_whole_file_digest_still_counts(tiny_models, tmp_path, monkeypatch):
    """The manifest's digests cover 64 MiB pieces, hashed on every core: a byte flipped in any piece fails the
    check. A snapshot written before the pieces (one "sha256" for the file) is still used when it matches."""
    piece = 4 << 10
    monkeypatch.setattr(fp8_snapshot, "PIECE", piece)  # the tiny model's file in several pieces
    path = tiny_models["llama"]
    first = _run(path, tmp_path)[1]
    (snap,) = (tmp_path / "fp8-snapshots").iterdir()
    weights, manifest = snap / "model.safetensors", snap / "manifest.json"
    m = json.loads(manifest.read_text())
    data = weights.read_bytes()
    assert m["piece_bytes"] == piece and len(m["sha256_pieces"]) == -(-len(data) // piece) > 2
    assert m["sha256_pieces"] == [hashlib.sha256(data[i : i + piece]).hexdigest() for i in range(0, len(data), piece)]

    old = {k: v for k, v in m.items() if k not in ("piece_bytes", "sha256_pieces")}
    manifest.write_text(json.dumps({**old, "sha256": hashlib.sha256(data).hexdigest()}))
    assert _run(path, tmp_path) == ("fp8 snapshot", first)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01  # a middle piece
    weights.write_bytes(bytes(flipped))
    assert _run(path, tmp_path) == ("checkpoint, quantized online", first)  # the old digest catches it too
    m = json.loads(manifest.read_text())  # rebuilt: pieces again
    assert "sha256_pieces" in m and _run(path, tmp_path) == ("fp8 snapshot", first)
    flipped = bytearray(weights.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    weights.write_bytes(bytes(flipped))
    assert _run(path, tmp_path) == ("checkpoint, quantized online", first)


def test_a_snapshot_that_fails_to_load_is_freed_before_the_rebuild(tiny_models, tmp_path, monkeypatch):
    """On a GPU two copies of the weights may not fit: the model the snapshot half-filled must be gone (no
    reference left, not even from a kept exception's traceback) before the rebuild allocates a new one."""
    import gc
    import weakref

    from engine.models.llama import LlamaForCausalLM

    path = tiny_models["llama"]
    _run(path, tmp_path)  # writes the snapshot
    first = []

    def damaged(self, weights):
        first.append(weakref.ref(self))
        raise ValueError("damaged tensor")

    monkeypatch.setattr(LlamaForCausalLM, "load_snapshot", damaged)
    gc.disable()  # reference counting alone must free it
    try:
        src, _ = _run(path, tmp_path)
        assert first and first[0]() is None
    finally:
        gc.enable()
    assert src == "checkpoint, quantized online"


def test_snapshot_is_half_the_bytes(tiny_models, tmp_path):
    path = tiny_models["llama"]
    _run(path, tmp_path)
    snap = next((tmp_path / "fp8-snapshots").iterdir()) / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(snap), framework="pt") as f:
        assert f.get_tensor("layers.0.qkv").dtype == torch.float8_e4m3fn
        assert f.get_tensor("embed").dtype == torch.float32  # embeddings stay in the model dtype


def _compressed_tensors_copy(src, dst, strategy: str):
    """Write `src` as a compressed-tensors FP8-Dynamic checkpoint (what llm-compressor produces and vLLM
    serves): fp8 linear weights + weight_scale, lm_head and embeddings untouched."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kernels.fp8 import quant_per_channel

    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            if strategy == "channel":
                wq, scale = quant_per_channel(t.float())  # [N, K] fp8, [N, 1]
            else:
                scale = t.float().abs().max() / 448
                wq = (t.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[name] = wq
            out[name + "_scale"] = scale.float()
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True},
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "dynamic": True,
                    "symmetric": True,
                },
            }
        },
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_prequantized_checkpoint_matches_online_quantization(tiny_models, tmp_path):
    src = tiny_models["qwen2"]
    ckpt = _compressed_tensors_copy(src, tmp_path / "fp8-dynamic", "channel")
    pre = LLM(model=str(ckpt), dtype="float32", log_stats_interval=0)
    assert pre.engine.weights_source == "fp8 checkpoint"
    assert pre.engine.model.layers[0].qkv.dtype == torch.float8_e4m3fn
    online = LLM(
        model=str(src), dtype="float32", quantization="fp8", cache_root=str(tmp_path / "c"), log_stats_interval=0
    )
    a = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in pre.generate(PROMPTS, PARAMS)]
    b = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in online.generate(PROMPTS, PARAMS)]
    assert a == b  # same per-channel quantization, same W8A8 arithmetic
    # per-tensor scales load too, and the fp32 model's greedy tokens mostly survive
    per_tensor = LLM(
        model=str(_compressed_tensors_copy(src, tmp_path / "pt", "tensor")), dtype="float32", log_stats_interval=0
    )
    outs = per_tensor.generate(PROMPTS, PARAMS)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


def test_unsupported_quantization_config_is_refused(tiny_llama, tmp_path):
    import shutil

    import pytest

    from engine import UnsupportedModelError

    dst = tmp_path / "q"
    shutil.copytree(tiny_llama, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for qc, words in (({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
                      ({"quant_method": "awq", "bits": 4}, "no tensor of the checkpoint")):  # fmt: skip
        (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
        with pytest.raises(UnsupportedModelError, match=words):
            LLM(model=str(dst))


def test_a_snapshot_is_kept_per_model_dtype(tiny_models, tmp_path):
    """The snapshot stores embeddings, norms and lm_head in the model dtype: an fp32 engine does not load what a
    bf16 engine wrote (it quantizes its own, under another key), and each then loads its own."""
    path = tiny_models["llama"]

    def start(dtype):
        llm = LLM(model=str(path), dtype=dtype, quantization="fp8", cache_root=str(tmp_path), log_stats_interval=0)
        return llm.engine.weights_source

    assert start("bfloat16") == "checkpoint, quantized online"
    assert start("float32") == "checkpoint, quantized online"
    assert len(list((tmp_path / "fp8-snapshots").iterdir())) == 2
    assert start("float32") == start("bfloat16") == "fp8 snapshot"
