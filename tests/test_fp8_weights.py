"""QUANTIZATION=fp8: W8A8 linear layers quantized per channel while loading, on the real SmolLM2 weights."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.test_fp8_kv import PROMPTS, _first_step, _gap

pytestmark = pytest.mark.slow  # the real SmolLM2 in fp8

W8A8_BOUND = 0.5  # mean |delta logprob| over the first token's top-5, in nats, fp32 against fp32


def _linear_bytes(llm) -> int:
    return sum(
        getattr(layer, n).numel() * getattr(layer, n).element_size()
        for layer in llm.engine.model.layers
        for n in layer.LINEARS
    )


def test_fp8_weights_half_the_bytes_and_close_outputs(smollm2_path, tmp_path):
    # a fresh cache root: no fp8 snapshot from an earlier run, so this quantizes online
    kw = dict(model=str(smollm2_path), dtype="bfloat16", log_stats_interval=0, cache_root=str(tmp_path))
    base, fp8 = LLM(**kw), LLM(quantization="fp8", **kw)
    assert fp8.engine.weights_source == "checkpoint, quantized online"
    layer = fp8.engine.model.layers[0]
    assert layer.qkv.dtype == torch.float8_e4m3fn and layer.fp8_scales["qkv"].shape == (layer.qkv.shape[0], 1)
    assert fp8.engine.model.embed.dtype == torch.bfloat16  # embeddings, lm_head and norms stay 16-bit
    assert _linear_bytes(fp8) * 2 == _linear_bytes(base)  # measured from the tensors, not computed
    # The fp8 model is built with fp8 linears (no 16-bit copy of them ever exists), and quantizing
    # each streamed q/k/v, gate/up slice alone gives exactly the bytes of quantizing the fused 16-bit weight
    from engine.models.llama import LlamaForCausalLM
    from kernels.fp8 import quant_per_channel

    empty = LlamaForCausalLM(fp8.engine.spec, torch.bfloat16, "cpu", 64, quantization="fp8")
    assert all(getattr(x, n).dtype == torch.float8_e4m3fn for x in empty.layers for n in x.LINEARS)
    for i in (0, 7):
        for n in layer.LINEARS:
            wq, scale = quant_per_channel(getattr(base.engine.model.layers[i], n))
            assert torch.equal(getattr(fp8.engine.model.layers[i], n).view(torch.uint8), wq.view(torch.uint8)), n
            assert torch.equal(fp8.engine.model.layers[i].fp8_scales[n], scale), n

    both = LLM(quantization="fp8", kv_cache_dtype="fp8", **kw)
    outs = both.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    del base, fp8, both

    kw["dtype"] = "float32"  # quality in fp32, the same on any CPU: see tests/test_fp8_kv.py's QUALITY_BOUND
    ref = _first_step(LLM(**kw))
    fp8 = LLM(quantization="fp8", **kw)
    got = _first_step(fp8)
    gap = _gap(got, ref)
    assert [max(d, key=d.get) for d in got] == [max(d, key=d.get) for d in ref], (got, ref)
    # Measured 0.26 nats mean |delta logprob| over the top-5 (the same on AVX-512 with and without bf16, AVX2 and
    # no vectors; in bf16 it moved 0.29-0.36 with the CPU's GEMM path). The per-token activation quant (W8A8,
    # vLLM's FP8-dynamic scheme) dominates on this 135M model. Whether that meets the fp8 perplexity target
    # (docs/benchmarks.md) is a benchmark's job, not this test's.
    assert gap < W8A8_BOUND, gap
    # the check can fail: a corrupted scale on one layer moves the outputs past the same bound (measured 1.17)
    fp8.engine.model.layers[3].fp8_scales["down"] *= 8
    corrupted = _gap(_first_step(fp8), ref)
    assert corrupted > W8A8_BOUND, (corrupted, gap)
