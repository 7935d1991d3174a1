"""FP8 (e4m3) KV cache: twice the tokens for the same bytes, calibrated per-layer scales, and outputs that stay
close to the unquantized cache on the real SmolLM2 weights."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow  # the real SmolLM2 with an fp8 KV cache

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three fruits:",
    "Photosynthesis is the process by which",
]


def _first_step(llm):
    """Top-5 logprobs of the first generated token: it depends on every prompt token's K/V in the cache."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    return [o.outputs[0].logprobs[0] for o in outs]


def _gap(a: list[dict], b: list[dict]) -> float:
    """Mean |logprob difference| over the tokens both top-5 lists contain."""
    diffs = [abs(x[t] - y[t]) for x, y in zip(a, b) for t in x if t in y]
    return sum(diffs) / len(diffs)


# Output quality is compared in fp32, fp8 against the unquantized model: the gap is then the quantization's alone
# and the same on any CPU. In bf16 each CPU's GEMM path adds its own rounding to both sides: over four arithmetics
# of one Zen 5 (AVX-512 with and without bf16, AVX2, none) the calibrated gap ranged 0.11-0.14 and the saturated
# one 0.62-1.17, so a ratio between the two held on one machine and not the next (commit f33e6ee).
QUALITY_BOUND = 0.25  # mean |delta logprob| over the first token's top-5, in nats


def test_fp8_kv_capacity_scales_and_quality(smollm2_path):
    kw = dict(model=str(smollm2_path), dtype="bfloat16", kv_cache_memory=64 << 20, log_stats_interval=0)
    base = LLM(**kw)
    fp8 = LLM(kv_cache_dtype="fp8", **kw)
    # capacity: 1 byte per element instead of 2, so twice the blocks from the same budget
    assert fp8.engine.runner.kv_caches.dtype == torch.float8_e4m3fn
    assert fp8.engine.block_manager.num_blocks == 2 * base.engine.block_manager.num_blocks
    assert fp8.engine.runner.kv_caches.element_size() * fp8.engine.runner.kv_caches.numel() <= 64 << 20
    # calibrated scales: one per layer for K and V, none a blind 1.0
    attn = fp8.engine.runner.attn
    assert attn.k_scales.shape == (30,) and bool((attn.k_scales > 0).all()) and bool((attn.v_scales > 0).all())
    assert not bool(torch.isclose(attn.k_scales, torch.ones(30)).any())
    # a full generation runs and frees everything
    outs = fp8.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert fp8.engine.block_manager.num_free_blocks == fp8.engine.block_manager.num_blocks
    del base, fp8

    kw["dtype"] = "float32"  # quality: see QUALITY_BOUND
    ref = _first_step(LLM(**kw))
    fp8 = LLM(kv_cache_dtype="fp8", **kw)
    got = _first_step(fp8)
    assert [max(d, key=d.get) for d in got] == [max(d, key=d.get) for d in ref]  # same greedy first token
    gap = _gap(got, ref)
    # Measured 0.16 nats on each of those four arithmetics (within 0.003).
    # The fp8 perplexity / KL targets are measured by a benchmark (bench/fp8_quality.py), not asserted here.
    assert gap < QUALITY_BOUND, gap
    # the check can fail: scales 100x too small saturate almost every K/V value, and the same bound rejects the
    # output (measured 0.57 on each arithmetic)
    attn = fp8.engine.runner.attn
    attn.set_kv_scales(attn.k_scales / 100, attn.v_scales / 100)
    saturated = _gap(_first_step(fp8), ref)
    assert saturated > QUALITY_BOUND, (saturated, gap)


def test_fp8_kv_scales_from_checkpoint(tiny_llama, tmp_path):
    """k_scale / v_scale tensors in the checkpoint (as vLLM's fp8 checkpoints carry) are used, not calibrated."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_llama / "model.safetensors"))
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.02 * (i + 1))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for f in tiny_llama.iterdir():
        if f.suffix == ".json" or f.name.startswith("tokenizer"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp8", log_stats_interval=0)
    attn = llm.engine.runner.attn
    torch.testing.assert_close(attn.k_scales, torch.tensor([0.01, 0.02]))
    torch.testing.assert_close(attn.v_scales, torch.tensor([0.02, 0.04]))
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_fp8_kv_triton_path_matches_torch_path(tiny_models):
    """The kernels read and write the fp8 cache with the same arithmetic as the CPU reference path."""
    kw = dict(
        model=str(tiny_models["llama"]),
        dtype="float32",
        kv_cache_dtype="fp8",
        block_size=8,
        max_num_batched_tokens=8,
        num_kv_blocks=16,
        max_model_len=64,
        log_stats_interval=0,
    )
    prompts = [{"prompt_token_ids": [5, 9, 33, 7, 21, 62, 11]}, {"prompt_token_ids": [40, 41]}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = LLM(kernel_backend="torch", **kw).generate(prompts, params)
    tri = LLM(kernel_backend="triton", **kw).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in tri] == [o.outputs[0].token_ids for o in ref]
