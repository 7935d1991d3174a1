"""A CPU step's decoder layers in one C call (engine/layers/native_stack.py, kernels/cpu_layers.c): the same tokens
and logprobs, bit for bit, as the layers run from Python over the same kernels, through chunked prefills mixed with
decodes, prefix-cache hits, and weights before and after their packed copies; on both GEMMs it drives (AVX512-BF16's
dot build, and the AVX2 one); with a qkv bias and a sliding window; and it stands aside where it does not apply."""

from __future__ import annotations

import pytest
import torch

from engine.layers import dense, native_stack
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from kernels import cpu_gemm
from kernels.cpu_gemm import Avx2Gemm
from kernels.cpu_layers import NativeLayers
from kernels.cpu_ops import CpuOps
from tests.utils import build_tiny_model

FAMILY = (LlamaForCausalLM, DecoderLayer)  # what engine/models/llama.py passes

# head_dim 32 (the C rotary takes D / 2 a multiple of 16), GQA 2, three layers
SHAPE = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    return {arch: build_tiny_model(root / arch, arch, **SHAPE) for arch in ("llama", "qwen2", "mistral-window")}


KINDS = [
    pytest.param("dot", marks=pytest.mark.skipif(not cpu_gemm.has_thin(), reason="no AVX512-BF16 here")),
    pytest.param("avx2", marks=pytest.mark.skipif(not cpu_gemm.has_avx2(), reason="no AVX2 + FMA here")),
]


def _engine(path, kind, monkeypatch):
    """An engine whose bf16 linears (on both paths) run `kind`: the dot build, or the AVX2 GEMM, forced where
    oneDNN or the dot build would take them."""
    from engine import LLM
    from engine.cpu_native import native_dir

    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory=8 << 20, log_stats_interval=0,
              max_num_batched_tokens=24)  # fmt: skip
    cache = native_dir(llm.engine.cfg, torch.device("cpu"))
    if kind == "avx2":
        avx2 = Avx2Gemm.get(cache, wait=True)
        assert avx2.lib is not None, avx2.error
        monkeypatch.setattr(dense, "_dot", lambda: None)  # dense() then asks onednn_bf16(), as on an AVX2 CPU
        monkeypatch.setattr(dense, "onednn_bf16", lambda: False)
        assert dense._avx2() is avx2
    else:
        assert dense._dot() is not None, "the dot build did not load"
    assert CpuOps.get(cache, wait=True).lib is not None and NativeLayers.get(cache, wait=True).lib is not None
    return llm


def _run(llm, params, prompts, on: bool):
    native_stack.ENABLED = on
    try:
        outs = llm.generate(prompts, params)
    finally:
        native_stack.ENABLED = True
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-window"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_stack_gives_the_python_layers_bits(models, arch, kind, monkeypatch):
    from engine import SamplingParams

    llm = _engine(models[arch], kind, monkeypatch)
    model = llm.engine.runner.model
    stack = native_stack.stack_for(model, *FAMILY)
    assert stack is not None
    ran = []
    call = native_stack.NativeStack.__call__
    monkeypatch.setattr(native_stack.NativeStack, "__call__", lambda self, *a: ran.append(r := call(self, *a)) or r)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    # prompts past the 24-token budget: chunked prefills beside decodes; the repeat hits the prefix cache
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 5 for j in range(n)]} for i, n in enumerate((3, 40, 17))]
    prompts.append(prompts[1])
    idle = llm.engine.idle
    idle.pack, pending = [], idle.pack  # first on the plain weights (each panel packed as it goes)
    plain = [_run(llm, params, prompts, on) for on in (True, False)]
    assert any(r is not None for r in ran), "the stack never ran"
    assert plain[0] == plain[1]
    idle.pack, packs = pending, dense.PACKS  # generate() drains the packing first
    ran.clear()
    packed = [_run(llm, params, prompts, on) for on in (True, False)]
    assert dense.PACKS > packs and stack.packs[0] == dense.PACKS and any(r is not None for r in ran)
    assert packed[0] == packed[1] == plain[0]


def test_the_stack_stands_aside_where_it_does_not_apply(models, tiny_models):
    from engine import LLM

    fp32 = LLM(model=str(models["llama"]), dtype="float32", kv_cache_memory=8 << 20, log_stats_interval=0)
    assert native_stack.stack_for(fp32.engine.runner.model, *FAMILY) is None  # fp32: the C ops are bf16 only
    qk_norm = LLM(model=str(tiny_models["qwen3"]), dtype="bfloat16", kv_cache_memory=8 << 20, log_stats_interval=0)
    assert native_stack.stack_for(qk_norm.engine.runner.model, *FAMILY) is None  # q/k norm: not in the C loop
    gemma = LLM(model=str(tiny_models["gemma2"]), dtype="bfloat16", kv_cache_memory=8 << 20, log_stats_interval=0)
    assert native_stack.stack_for(gemma.engine.runner.model, *FAMILY) is None  # a subclass: its layer differs
