"""Quantized checkpoints (engine/quant/): each format written from a tiny model by a writer that follows its
published layout (bench/quant_writers.py), loaded by the engine, and compared with HF transformers running the
weights it stands for (dequantized, fp32): the same weights exactly, the same greedy tokens. compressed-tensors is
also read back by its own library, so the test is not only our reader against our writer. Each format's
perturbation (a wrong nibble order, swapped scales, a lost zero point or permutation) must break the match."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench import quant_writers as qw
from engine import LLM, SamplingParams, UnsupportedModelError
from tests.utils import hf_greedy

PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 12, 99, 150, 3, 8, 64]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
FORMATS = {
    "awq": lambda s, q, r: qw.write_awq(s, q, r, group=32),
    "gptq-4bit-sym": lambda s, q, r: qw.write_gptq(s, q, r, bits=4, group=32, sym=True),
    "gptq-4bit-asym-actorder": lambda s, q, r: qw.write_gptq(s, q, r, bits=4, group=32, sym=False, desc_act=True),
    "gptq-8bit-channel": lambda s, q, r: qw.write_gptq(s, q, r, bits=8, group=None, sym=True),
    "ct-w4a16-sym": lambda s, q, r: qw.write_compressed_tensors(s, q, r, bits=4, group=32, sym=True),
    "ct-w4a16-asym": lambda s, q, r: qw.write_compressed_tensors(s, q, r, bits=4, group=32, sym=False),
    "ct-w8a16": lambda s, q, r: qw.write_compressed_tensors(s, q, r, bits=8, group=32, sym=True),
    "ct-w4a16-channel-asym": lambda s, q, r: qw.write_compressed_tensors(s, q, r, bits=4, group=None, sym=False),
    "gptq-4bit-asym-v2": lambda s, q, r: qw.write_gptq(s, q, r, bits=4, group=32, sym=False, v2=True),
    "fp8-block": lambda s, q, r: qw.write_fp8_block(s, q, r, block=(32, 32)),
}


@pytest.fixture(scope="module")
def written(tiny_llama, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("quant")
    out = {}
    for name, write in FORMATS.items():
        write(tiny_llama, root / name, root / f"{name}-ref")
        out[name] = (root / name, root / f"{name}-ref")
    return out


def _ours(path: Path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0, **kw)


def _weights(llm: LLM) -> dict[str, torch.Tensor]:
    layer = llm.engine.model.layers[0]
    return {n: getattr(layer, n).detach().float() for n in ("qkv", "o_proj", "gate_up", "down")}


def _ref_weights(ref: Path) -> dict[str, torch.Tensor]:
    t = load_file(str(ref / "model.safetensors"))
    p = "model.layers.0."
    cat = lambda *names: torch.cat([t[p + n + ".weight"] for n in names])  # noqa: E731
    return {"qkv": cat("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": cat("self_attn.o_proj"),
            "gate_up": cat("mlp.gate_proj", "mlp.up_proj"), "down": cat("mlp.down_proj")}  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_is_the_weights_it_stands_for(written, fmt):
    q, ref = written[fmt]
    llm = _ours(q)
    try:
        ours, want = _weights(llm), _ref_weights(ref)
        for name in ours:  # dequantized at load on CPU: exactly the reference's fp32 values
            assert torch.equal(ours[name], want[name]), (fmt, name)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
        assert got == [ids for ids, _ in hf_greedy(ref, PROMPTS, 8)]
    finally:
        llm.engine.shutdown()


def test_compressed_tensors_own_decompression_agrees(written):
    """The library vLLM reads compressed-tensors with, decompressing the same file: our weights equal its."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    for fmt in ("ct-w4a16-sym", "ct-w4a16-asym", "ct-w8a16", "ct-w4a16-channel-asym"):
        q, _ = written[fmt]
        cfg = json.loads((q / "config.json").read_text())["quantization_config"]
        scheme = QuantizationScheme(
            targets=["Linear"], weights=QuantizationArgs(**cfg["config_groups"]["group_0"]["weights"])
        )
        t = load_file(str(q / "model.safetensors"))
        prefix = "model.layers.0.mlp.down_proj."
        state = {k.removeprefix(prefix): v for k, v in t.items() if k.startswith(prefix)}
        theirs = PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()
        llm = _ours(q)
        try:
            assert torch.allclose(_weights(llm)["down"], theirs, atol=1e-6, rtol=0), fmt
        finally:
            llm.engine.shutdown()


def test_transformers_own_fine_grained_fp8_reader_agrees(written):
    """transformers reads HF's block fp8 itself (FineGrainedFP8Config(dequantize=True), on CPU): its weights are
    ours, and its greedy tokens too."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    q, _ = written["fp8-block"]
    fp8 = FineGrainedFP8Config(dequantize=True)
    theirs = AutoModelForCausalLM.from_pretrained(str(q), dtype=torch.float32, quantization_config=fp8)
    llm = _ours(q)
    try:
        layer = theirs.model.layers[0]
        assert torch.equal(_weights(llm)["down"], layer.mlp.down_proj.weight.float())
        want = [theirs.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p):]
                .tolist() for p in PROMPTS]  # fmt: skip
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
        assert got == want
    finally:
        llm.engine.shutdown()


def _tamper(src: Path, dst: Path, fn) -> Path:
    import shutil

    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    fn(t)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _natural_order(words: torch.Tensor) -> torch.Tensor:
    """An AWQ word repacked with its nibbles in natural order (what a reader ignoring AWQ's order would assume)."""
    from engine.quant.convert import AWQ_ORDER
    from kernels.int_gemm import unpack

    return qw.pack_words(unpack(words, 4, order=AWQ_ORDER), 4)


def _bytes_reversed(words: torch.Tensor) -> torch.Tensor:
    """int8 codes in each word in the opposite order (a reader with the wrong byte order)."""
    return (
        words.contiguous()
        .view(torch.uint8)
        .reshape(*words.shape, 4)
        .flip(-1)
        .reshape(words.shape[0], -1)
        .view(torch.int32)
    )


PERTURB = {
    "awq": lambda t: t.update({k: _natural_order(v) for k, v in t.items() if k.endswith("qweight")}),
    "gptq-4bit-sym": lambda t: t.update({k: v.flip(0) for k, v in t.items() if k.endswith("scales")}),
    "gptq-4bit-asym-actorder": lambda t: t.update({k: torch.arange(len(v), dtype=v.dtype) // 32
                                                   for k, v in t.items() if k.endswith("g_idx")}),
    "ct-w4a16-asym": lambda t: [t.pop(k) for k in list(t) if k.endswith("weight_zero_point")],
    "ct-w4a16-sym": lambda t: t.update({k: v.flip(1) for k, v in t.items() if k.endswith("weight_scale")}),
    "gptq-8bit-channel": lambda t: t.update({k: _bytes_reversed(v) for k, v in t.items() if k.endswith("qweight")}),
    "fp8-block": lambda t: t.update({k: v.t().contiguous() if v.shape[0] == v.shape[1] else v.flip(0)
                                     for k, v in t.items() if k.endswith("scale_inv")}),
}  # fmt: skip


@pytest.mark.parametrize("fmt", PERTURB)
def test_a_perturbed_checkpoint_breaks_the_match(written, fmt, tmp_path):
    q, ref = written[fmt]
    bad = _tamper(q, tmp_path / "bad", PERTURB[fmt])
    try:
        llm = _ours(bad)
    except UnsupportedModelError:
        return  # refused outright (a zero point missing for an asymmetric scheme): also a failure to match
    try:
        ours, want = _weights(llm), _ref_weights(ref)
        assert any(not torch.allclose(ours[n], want[n], atol=1e-4) for n in ours), fmt
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("fmt", ["awq", "gptq-4bit-asym-actorder", "ct-w8a16", "fp8-block"])
def test_packed_on_the_triton_backend(written, fmt):
    """The GPU's path, run by the Triton interpreter: the linears stay packed (int32 words, scales, zeros, the
    act-order permutation) and the int GEMM dequantizes in its main loop; greedy tokens equal HF's. Block fp8 keeps
    its e4m3 weights and block scales, and quantizes activations per token group (W8A8, as on a GPU): its tokens
    are compared with HF running the dequantized weights, which its activation rounding may part from late."""
    q, ref = written[fmt]
    llm = _ours(q, kernel_backend="triton")
    try:
        layer = llm.engine.model.layers[0]
        assert layer.qkv.dtype == (torch.float8_e4m3fn if fmt == "fp8-block" else torch.int32)
        if fmt != "fp8-block":
            assert (layer.quant_linears.perm["qkv"] is not None) == (fmt == "gptq-4bit-asym-actorder")
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:1]], GREEDY)]
        assert got == [ids for ids, _ in hf_greedy(ref, PROMPTS[:1], 8)]
    finally:
        llm.engine.shutdown()


def test_block_fp8_mixture_of_experts(tiny_models, tmp_path):
    """A Qwen3-MoE checkpoint in block fp8, experts included (the router stays 16-bit, as the official releases
    have it): dequantized exactly on CPU; on the Triton backend the experts are requantized per channel for the
    fused MoE kernel while attention keeps its blocks, and the greedy tokens still follow HF's."""
    q, ref = tmp_path / "q", tmp_path / "ref"
    qw.write_fp8_block(tiny_models["qwen3-moe"], q, ref, block=(16, 16))
    want = [ids for ids, _ in hf_greedy(ref, PROMPTS[:1], 6)]
    for kw in ({}, {"kernel_backend": "triton"}):
        llm = _ours(q, **kw)
        try:
            layer = next(x for x in llm.engine.model.layers if x.moe)
            assert layer.w13.dtype == (torch.float8_e4m3fn if kw else torch.float32)
            out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=6,
                                                                                 ignore_eos=True))  # fmt: skip
            got = out[0].outputs[0].token_ids
            assert got == want[0] if not kw else got[:3] == want[0][:3], (kw, got, want)
        finally:
            llm.engine.shutdown()


@pytest.mark.parametrize("fmt", list(FORMATS) + ["fp8-block-moe"])
def test_the_planner_counts_the_bytes_each_format_allocates(written, fmt, tiny_models, tmp_path):
    """memory.weight_bytes, which python -m warmup.plan and the start's pool sizing use, against the tensors the
    packed model holds after loading: parameters, scales, zero points, permutations (and dequantized on CPU: a
    16-bit model's bytes)."""
    from engine import memory

    if fmt == "fp8-block-moe":
        q = tmp_path / "moe"
        qw.write_fp8_block(tiny_models["qwen3-moe"], q, tmp_path / "moe-ref", block=(16, 16))
    else:
        q, _ = written[fmt]
    for packed in (True, False):
        llm = _ours(q, kernel_backend="triton" if packed else "torch")
        try:
            model = llm.engine.model
            held = sum(p.numel() * p.element_size() for p in model.parameters())
            if model.spec.tie_word_embeddings:
                held -= model.embed.numel() * model.embed.element_size()  # one tensor, counted once
            for layer in model.layers:
                extra = [*layer.fp8_scales.values(), *getattr(layer, "expert_scales", {}).values()]
                held += sum(t.numel() * t.element_size() for t in extra)
                held += layer.quant_linears.nbytes() if layer.quant_linears is not None else 0
            assert memory.weight_bytes(model.spec, 4, None, packed) == held, (fmt, packed)
        finally:
            llm.engine.shutdown()


def test_static_fp8_activation_scales(tiny_llama, tmp_path):
    """compressed-tensors fp8 with static per-tensor input scales (calibrated as llm-compressor does): the fused
    linears take the largest of their parts' scales, and the activations are quantized with it. The reference is
    HF on the dequantized weights with each linear's input fake-quantized the same way (a forward pre-hook):
    greedy tokens equal. A scale too small clips the activations and changes the output."""
    q, ref = tmp_path / "q", tmp_path / "ref"
    qw.write_fp8_static(tiny_llama, q, ref, calibrate=PROMPTS)
    t = load_file(str(q / "model.safetensors"))
    parts = [t[f"model.layers.0.self_attn.{p}_proj.input_scale"] for p in "qkv"]
    llm = _ours(q)
    try:
        layer = llm.engine.model.layers[0]
        assert layer.input_scales["qkv"].item() == max(p.item() for p in parts)
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        assert [o.outputs[0].token_ids for o in got] == _hf_static(ref, t, PROMPTS, 8)
        first = got[0].outputs[0].logprobs
        layer.input_scales["gate_up"] = layer.input_scales["gate_up"] / 64  # clips most activations
        clipped = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)[0].outputs[0]
        assert clipped.token_ids != got[0].outputs[0].token_ids or clipped.logprobs != first
    finally:
        llm.engine.shutdown()


def _hf_static(ref: Path, tensors: dict, prompts, n: int) -> list[list[int]]:
    """HF greedy on `ref` with every linear's input quantized to fp8 by its static scale (the fused parts' max)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).eval()
    fused = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}
    scales: dict[tuple, float] = {}
    for name, t in tensors.items():
        if name.endswith(".input_scale"):
            parent, proj = name.removesuffix(".input_scale").rsplit(".", 1)
            key = (parent.rsplit(".", 1)[0], fused.get(proj, proj))
            scales[key] = max(scales.get(key, 0.0), t.item())

    def fake_quant(s):
        return lambda mod, args: ((args[0] / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,)

    for name, m in model.named_modules():
        parent, _, proj = name.rpartition(".")
        if proj in qw.LINEARS:
            m.register_forward_pre_hook(fake_quant(scales[(parent.rsplit(".", 1)[0], fused.get(proj, proj))]))
    out = []
    with torch.no_grad():
        for ids in prompts:
            g = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
            out.append(g[0, len(ids) :].tolist())
    return out


def test_tensor_parallel_shards_cut_whole_groups(tmp_path):
    """Each rank's packed shard (engine/parallel/shard.py) dequantizes to exactly that rank's slice of the whole
    dequantized weight: rows for q/k/v and gate/up, input columns (whole words and groups) for o_proj and down,
    block rows and columns for fp8's scales. A size that would cut a group or a block is refused, naming it."""
    import dataclasses

    from engine import ConfigError
    from engine.models.spec import ModelSpec
    from engine.parallel import shard
    from engine.quant.convert import Converter, block_dequantize
    from kernels.int_gemm import dequantize
    from tests.utils import build_tiny_model

    wide = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4, intermediate_size=256)
    src = build_tiny_model(tmp_path / "m", "llama", **wide)
    for name, write in (("awq", lambda q, r: qw.write_awq(src, q, r, group=32)),
                        ("gptq8", lambda q, r: qw.write_gptq(src, q, r, bits=8, group=None)),
                        ("block", lambda q, r: qw.write_fp8_block(src, q, r, block=(32, 32)))):  # fmt: skip
        q, ref = tmp_path / name, tmp_path / f"{name}-ref"
        write(q, ref)
        spec = ModelSpec.from_hf(json.loads((q / "config.json").read_text()))
        shard.check(spec, 2)
        full = dict(
            Converter(spec.quant, torch.float32, dense=False)(iter(load_file(str(q / "model.safetensors")).items()))
        )
        want = load_file(str(ref / "model.safetensors"))
        for module, cut in (("self_attn.k_proj", 0), ("mlp.down_proj", 1), ("self_attn.o_proj", 1), ("mlp.up_proj", 0)):
            m = f"model.layers.0.{module}"
            for rank in (0, 1):
                s = shard.Shard(spec, rank, 2)
                if spec.quant.kind == "fp8":
                    wq = s.tensor(f"{m}.weight", full[f"{m}.weight"])
                    scale = s.tensor(f"{m}.weight_scale_inv", full[f"{m}.weight_scale_inv"])
                    w = block_dequantize(wq, scale, (32, 32), torch.float32)
                else:
                    part = {k: s.tensor(f"{m}.iq_{k}", full[f"{m}.iq_{k}"]) for k in ("weight", "scales", "zeros")
                            if f"{m}.iq_{k}" in full}  # fmt: skip
                    k_local = part["weight"].shape[1] * (32 // spec.quant.bits)
                    group = spec.quant.group_size or k_local
                    w = dequantize(
                        part["weight"],
                        part["scales"],
                        part.get("zeros"),
                        spec.quant.bits,
                        group,
                        k_local,
                        torch.float32,
                    )
                proj = module.rsplit(".", 1)[1]
                start, n = (s.column_rows() if cut == 0 else s.row_columns())[proj]
                assert torch.equal(w, want[f"{m}.weight"].narrow(cut, start, n)), (name, module, rank)
        coarse = dataclasses.replace(spec, quant=dataclasses.replace(spec.quant, group_size=128, block=(128, 128)))
        with pytest.raises(ConfigError, match="quantization groups|scale blocks"):
            shard.check(coarse, 2)


@pytest.mark.parametrize("fmt", ["awq", "gptq-4bit-asym-actorder", "fp8-block"])
def test_lora_and_fp8_kv_on_a_quantized_base(written, tiny_llama, fmt, tmp_path):
    """Adapters stay 16-bit on a quantized base (as vLLM), and KV_CACHE_DTYPE=fp8 works with every format: each
    gives the tokens of the same engine on the 16-bit checkpoint of the same weights (the dequantized reference),
    dequantized on CPU and packed on the Triton backend (where block fp8 also quantizes its activations, so only
    the adapter's effect is checked there)."""
    from engine import LoRARequest
    from tests.lora_fixtures import make_peft_adapter

    adapter, _ = make_peft_adapter(tiny_llama, tmp_path / "adapter")
    q, ref = written[fmt]
    lora = dict(enable_lora=True, lora_modules=(("a", str(adapter)),), max_lora_rank=8)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for backend in ("torch", "triton"):
        runs = {}
        for name, path in (("q", q), ("ref", ref)):
            llm = _ours(path, kernel_backend=backend, kv_cache_dtype="fp8", **lora)
            try:
                with_lora = llm.generate(prompts[:1], GREEDY, lora=LoRARequest("a"))[0].outputs[0].token_ids
                runs[name] = (with_lora, llm.generate(prompts[:1], GREEDY)[0].outputs[0].token_ids)
            finally:
                llm.engine.shutdown()
        if not (fmt == "fp8-block" and backend == "triton"):  # there W8A8: its activations are quantized too
            assert runs["q"] == runs["ref"], (backend, runs)
        assert runs["q"][0] != runs["q"][1]  # the adapter changed the output: it was applied


def test_a_linear_left_16_bit_is_named_where_layouts_cannot_mix(written, tmp_path):
    """A checkpoint that keeps one decoder linear 16-bit (modules_to_not_convert, compressed-tensors' ignore): the
    dequantized path (CPU) serves it, exactly; the packed path refuses it at load, naming the module."""
    q, ref = written["awq"]
    down = "model.layers.1.mlp.down_proj"
    want = load_file(str(ref / "model.safetensors"))[f"{down}.weight"]

    def keep_16_bit(t):
        for suffix in ("qweight", "qzeros", "scales"):
            t.pop(f"{down}.{suffix}")
        t[f"{down}.weight"] = want

    mixed = _tamper(q, tmp_path / "mixed", keep_16_bit)
    llm = _ours(mixed)
    try:
        assert torch.equal(llm.engine.model.layers[1].down.float(), want.float())
    finally:
        llm.engine.shutdown()
    with pytest.raises(UnsupportedModelError, match=f"{down} is 16-bit"):
        _ours(mixed, kernel_backend="triton")
