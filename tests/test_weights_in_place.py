"""Weights kept in place on CPU: a tensor whose bytes lie in the file as our parameter holds them becomes the
parameter, a view of the file's map (engine/models/loading.py `Kept`); files we write are laid out that way
(engine/weights/layout.py). Whatever the layout, the model computes the same."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from engine.models.loading import Kept
from engine.weights import header, layout, reader
from tests.utils import build_tiny_model

ENGINE = dict(dtype="float32", num_kv_blocks=64, log_stats_interval=0)


def _relayout(model_dir, key) -> None:
    """Rewrite model_dir's model.safetensors with layout.write, tensors ordered by `key`."""
    f = model_dir / "model.safetensors"
    with safe_open(str(f), framework="pt") as h:
        meta = h.metadata()
        tensors = [(n, h.get_tensor(n).clone()) for n in sorted(h.keys(), key=key)]
    layout.write(f, tensors, meta)


def _data_start(f) -> int:
    with f.open("rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def test_layout_write_is_a_standard_file_aligned_in_the_given_order(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("z.first", torch.randn(4, 16, generator=g)),  # 256 B
        ("odd", torch.randn(3, generator=g).half()),  # 6 B: goes last, or it would misalign what follows
        ("a.second", torch.randn(8, 8, generator=g).bfloat16()),  # 128 B
        ("fp8", torch.randn(64, generator=g).to(torch.float8_e4m3fn)),  # 64 B
        ("empty", torch.zeros(0, 4)),
    ]
    f = tmp_path / "w.safetensors"
    layout.write(f, tensors, {"format": "pt"})
    start = _data_start(f)
    assert start % 64 == 0
    with safe_open(str(f), framework="pt") as h:
        assert h.metadata() == {"format": "pt"}
        for name, t in tensors:
            assert torch.equal(h.get_tensor(name).view(torch.uint8), t.view(torch.uint8)), name
    header = json.loads(f.read_bytes()[8:start])
    order = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    assert [k for _, k in order] == ["z.first", "a.second", "fp8", "empty", "odd"]
    assert all(off % 64 == 0 for off, k in order if k != "odd")


def test_fused_order_puts_parts_in_row_order():
    names = [f"model.layers.{i}.{m}.weight" for i in (1, 0) for m in (
        "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj",
        "self_attn.v_proj", "input_layernorm")]  # fmt: skip
    names += ["model.norm.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias"]
    got = sorted(names, key=layout.fused_order)
    assert got[:2] == ["model.embed_tokens.weight", "model.norm.weight"]
    layer0 = [n.split(".", 3)[3] for n in got if n.startswith("model.layers.0.")]
    assert layer0[:5] == [f"{m}.weight" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")]  # fmt: skip
    assert layer0[-1] == "self_attn.q_proj.bias"  # biases after every weight of the layer


def _engine(path):
    from engine import LLM

    return LLM(str(path), **ENGINE)


def _greedy(llm, n=6):
    from engine import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 9, 2, 7]}], params)
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, fused and kept too
def test_engine_layout_keeps_every_weight_and_computes_the_same(tmp_path, arch):
    hf = build_tiny_model(tmp_path / "hf", arch)
    ref = _engine(hf)
    kept = ref.engine.model.kept
    assert kept.kept_bytes == 0 and kept.copied_bytes > 0  # HF's file: 8 bytes off alignment, q/k/v apart
    want = _greedy(ref)
    ref.engine.shutdown()

    ours = build_tiny_model(tmp_path / "ours", arch)
    _relayout(ours, layout.fused_order)
    llm = _engine(ours)
    model = llm.engine.model
    matrices = [p for p in model.parameters() if p.dim() == 2]
    assert model.kept.kept_bytes >= sum(p.numel() * p.element_size() for p in matrices)
    assert model.kept.kept_bytes + model.kept.copied_bytes == kept.copied_bytes  # the same bytes, placed otherwise
    f = ours / "model.safetensors"
    lo, size = None, f.stat().st_size
    for p in matrices:  # every weight matrix lies inside the file's map (a small bias may not: sizes of 64 B first)
        base = p.untyped_storage()
        assert base.nbytes() == size, "not a view of the weights file"
        lo = base.data_ptr() if lo is None else lo
        assert base.data_ptr() == lo and p.data_ptr() % 64 == 0
    assert _greedy(llm) == want
    llm.engine.shutdown()


def test_a_part_that_is_not_where_the_view_says_makes_a_copy(tmp_path):
    """q first and aligned (the parameter becomes a view from there), then v where k should be: the parameter
    becomes a copy of what it held so far, and every part still lands in its rows."""
    hf = build_tiny_model(tmp_path / "hf", "llama")
    ref = _engine(hf)
    want = _greedy(ref)
    ref.engine.shutdown()
    swap = {"q_proj": -3, "v_proj": -2, "k_proj": -1}  # q, v, k: v lies in k's place

    def key(name):
        k = layout.fused_order(name)
        part = name.split(".")[-2]
        return (*k[:2], swap[part], name) if part in swap else k

    _relayout(hf, key)
    llm = _engine(hf)
    kept = llm.engine.model.kept
    assert kept.copied_bytes > 0 and kept.kept_bytes > 0  # q kept then copied; gate/up, o, down... kept
    qkv = llm.engine.model.layers[0].qkv
    assert qkv.untyped_storage().nbytes() == qkv.numel() * qkv.element_size()  # its own memory now
    assert _greedy(llm) == want
    llm.engine.shutdown()


def test_kept_refuses_what_is_not_a_mapped_view():
    k = Kept()
    param = torch.nn.Parameter(torch.zeros(4, 16), False)
    assert not k.place(param, None, torch.ones(4, 16))  # an ordinary tensor: copied by the caller
    assert k.copied_bytes == 4 * 16 * 4 and k.kept_bytes == 0


def test_mapped_only_while_handed_out(tmp_path):
    hf = build_tiny_model(tmp_path / "hf", "llama")
    views = []
    for name, t in reader.iter_weights(hf):
        assert reader.mapped(t), name
        views.append(t)
    assert not any(reader.mapped(t) for t in views)  # the loader keeps views only while the files are being read
    data = (hf / "model.safetensors").read_bytes()
    start = _data_start(hf / "model.safetensors")
    with safe_open(str(hf / "model.safetensors"), framework="pt") as h:
        for (name, t), e in zip(reader.iter_weights(hf), header.entries(hf / "model.safetensors"), strict=True):
            assert name == e.name and torch.equal(t, h.get_tensor(name))
            assert data[e.start : e.start + e.nbytes] == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert start > 8


def test_fp8_snapshot_is_kept_in_place(tmp_path):
    """Snapshots are written by layout.write: the second start keeps every fp8 weight where the file has it."""
    hf = build_tiny_model(tmp_path / "hf", "llama")
    kw = dict(ENGINE, quantization="fp8", cache_root=str(tmp_path / "cache"))
    from engine import LLM

    first = LLM(str(hf), **kw)
    assert first.engine.weights_source == "checkpoint, quantized online"
    want = _greedy(first)
    first.engine.shutdown()
    again = LLM(str(hf), **kw)
    assert again.engine.weights_source == "fp8 snapshot"
    model = again.engine.model
    assert model.kept.copied_bytes == 0 and model.kept.kept_bytes > 0
    assert model.layers[0].qkv.dtype == torch.float8_e4m3fn and reader.mapped(model.layers[0].qkv) is False
    assert model.layers[0].qkv.untyped_storage().nbytes() > model.layers[0].qkv.numel()  # a view of the snapshot
    assert _greedy(again) == want
    again.engine.shutdown()
