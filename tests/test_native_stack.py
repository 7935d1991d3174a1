"""A CPU step's decoder layers in one C call (engine/layers/native_stack.py, kernels/cpu_layers.c): the same tokens
and logprobs, bit for bit, as the layers run from Python over the same kernels (an engine of each), through chunked
prefills mixed with decodes, prefix-cache hits, and weights before and after their packed copies; on both GEMMs it
drives (the thin GEMM on AVX512-BF16, AMX or not, and the AVX2 one); with a qkv bias and a sliding window; at shapes
whose ops split over threads; and it stands aside (the Python loop runs) where it does not apply, per model and per
step, and builds its structures again when a weight changes."""

from __future__ import annotations

import pytest
import torch

from engine.layers import attention, dense, native_stack
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from kernels import cpu_gemm
from kernels.cpu_gemm import Avx2Gemm
from kernels.cpu_layers import NativeLayers
from kernels.cpu_ops import CpuOps
from tests.utils import build_tiny_model

FAMILY = (LlamaForCausalLM, DecoderLayer)  # what engine/models/llama.py passes
# head_dim 32 (the C rotary takes D / 2 a multiple of 16), GQA 2, three layers
SHAPE = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
# head_dim 64, GQA 4, rows enough for the norm, rotary and SiLU to split over OpenMP threads (PAR_MIN)
WIDE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2)
KINDS = [
    pytest.param("thin", marks=pytest.mark.skipif(not cpu_gemm.has_thin(), reason="no AVX512-BF16 here")),
    pytest.param("avx2", marks=pytest.mark.skipif(not cpu_gemm.has_avx2(), reason="no AVX2 + FMA here")),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    out = {arch: build_tiny_model(root / arch, arch, **SHAPE) for arch in ("llama", "qwen2", "mistral-window")}
    out["wide"] = build_tiny_model(root / "wide", "qwen2", **WIDE)
    return out


def _engine(path, kind, monkeypatch, batched: int = 24, **kw):
    """An engine whose bf16 linears (on both paths) run `kind`: the thin GEMM, or the AVX2 GEMM, forced where
    oneDNN or the thin GEMM would take them; its C kernels loaded."""
    from engine import LLM
    from engine.cpu_native import native_dir

    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory=8 << 20, log_stats_interval=0,
              max_num_batched_tokens=batched, **kw)  # fmt: skip
    cache = native_dir(llm.engine.cfg, torch.device("cpu"))
    if kind == "avx2":
        avx2 = Avx2Gemm.get(cache, wait=True)
        assert avx2.lib is not None, avx2.error
        monkeypatch.setattr(dense, "_thin", lambda: None)  # dense() then asks onednn_bf16(), as on an AVX2 CPU
        monkeypatch.setattr(dense, "onednn_bf16", lambda: False)
        assert dense._avx2() is avx2
    else:
        assert dense._thin() is not None, "the thin GEMM did not load"
    assert CpuOps.get(cache, wait=True).lib is not None and NativeLayers.get(cache, wait=True).lib is not None
    return llm


@pytest.fixture
def calls(monkeypatch) -> list:
    """What each NativeStack call returned (None: it stood aside)."""
    out = []
    call = native_stack.NativeStack.__call__
    monkeypatch.setattr(native_stack.NativeStack, "__call__", lambda self, *a: out.append(r := call(self, *a)) or r)
    return out


def _params(n: int = 12):
    from engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, logprobs=3, ignore_eos=True)


def _prompts(lengths=(3, 40, 17)):
    """Prompts past the 24-token budget (chunked prefills beside decodes); the last repeats one (prefix hits)."""
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 5 for j in range(n)]} for i, n in enumerate(lengths)]
    return prompts + [prompts[1]]


def _run(llm, prompts, params, on: bool):
    native_stack.ENABLED = on
    try:
        outs = llm.generate(prompts, params)
    finally:
        native_stack.ENABLED = True
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _plain_then_packed(llm, prompts, params, on: bool, calls: list):
    """Outputs on the plain weights (their panels packed as the GEMM goes), then once IdleWork has packed them;
    with the stack on, it ran every step of both and built its structures again for the packed copies."""
    idle, stack = llm.engine.idle, native_stack.stack_for(llm.engine.runner.model, *FAMILY)
    idle.pack, pending = [], idle.pack
    plain = _run(llm, prompts, params, on)
    before = stack.signature
    idle.pack = pending  # generate() drains the packing first
    packed = _run(llm, prompts, params, on)
    if on:
        assert calls and all(r is not None for r in calls), "the stack stood aside"
        assert stack.signature != before
    return plain, packed


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-window", "wide"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_stack_gives_the_python_layers_bits(models, arch, kind, monkeypatch, calls):
    wide = arch == "wide"
    prompts, params, batched = _prompts((90, 150, 7) if wide else (3, 40, 17)), _params(), 160 if wide else 24
    on = _plain_then_packed(_engine(models[arch], kind, monkeypatch, batched), prompts, params, True, calls)
    calls.clear()
    # the reference: the Python loop in an engine of its own (its own prefix cache)
    off = _plain_then_packed(_engine(models[arch], kind, monkeypatch, batched), prompts, params, False, calls)
    assert not calls and on == off


def test_the_stack_stands_aside_where_it_does_not_apply(models, tiny_models):
    from engine import LLM

    fp32 = LLM(model=str(models["llama"]), dtype="float32", kv_cache_memory=8 << 20, log_stats_interval=0)
    assert native_stack.stack_for(fp32.engine.runner.model, *FAMILY) is None  # fp32: the C ops are bf16 only
    qk_norm = LLM(model=str(tiny_models["qwen3"]), dtype="bfloat16", kv_cache_memory=8 << 20, log_stats_interval=0)
    assert native_stack.stack_for(qk_norm.engine.runner.model, *FAMILY) is None  # q/k norm: not in the C loop
    gemma = LLM(model=str(tiny_models["gemma2"]), dtype="bfloat16", kv_cache_memory=8 << 20, log_stats_interval=0)
    assert native_stack.stack_for(gemma.engine.runner.model, *FAMILY) is None  # a subclass: its layer differs


@pytest.mark.skipif(not cpu_gemm.has_thin(), reason="no AVX512-BF16 here")
def test_the_stack_stands_aside_for_a_step_it_does_not_take(models, monkeypatch, calls):
    """Per step: an fp8 KV cache (its rows are quantized by torch), the C attention not writing the rows, the
    GEMM not taking the rows: the Python loop runs, with the Python loop's result."""
    prompts, params = _prompts(), _params(6)
    ref = _run(_engine(models["llama"], "thin", monkeypatch), prompts, params, False)
    fp8 = _engine(models["llama"], "thin", monkeypatch, kv_cache_dtype="fp8")
    calls.clear()
    _run(fp8, prompts, params, True)
    assert calls and all(r is None for r in calls)
    for switch in ((attention, "NATIVE_WRITE", False), (cpu_gemm, "MAX_ROWS", 0)):
        llm = _engine(models["llama"], "thin", monkeypatch)
        with monkeypatch.context() as m:
            m.setattr(*switch)
            calls.clear()
            got = _run(llm, prompts, params, True)
        assert calls and all(r is None for r in calls), switch
        if switch[1] == "NATIVE_WRITE":
            assert got == ref


@pytest.mark.skipif(not cpu_gemm.has_thin(), reason="no AVX512-BF16 here")
def test_the_stack_follows_a_weight_that_changes(models, monkeypatch, calls):
    """A bias changed in place and a weight replaced are read again (the structures hold addresses); a layer made
    fp8 (quantize_fp8) leaves the C loop for the Python one."""
    prompts, params = _prompts(), _params(6)
    llms = {on: _engine(models["qwen2"], "thin", monkeypatch) for on in (True, False)}
    before = _run(llms[True], prompts, params, True)
    assert before == _run(llms[False], prompts, params, False)
    for llm in llms.values():  # after the structures were built
        layer = llm.engine.runner.model.layers[0]
        with torch.no_grad():
            layer.qkv_bias.mul_(-1)
            layer.down = torch.nn.Parameter(layer.down.data * 2, requires_grad=False)
    calls.clear()
    changed = _run(llms[True], prompts, params, True)
    assert calls and all(r is not None for r in calls)
    assert changed == _run(llms[False], prompts, params, False) and changed != before
    for llm in llms.values():
        llm.engine.runner.model.layers[1].quantize_fp8()
    calls.clear()
    assert _run(llms[True], prompts, params, True) == _run(llms[False], prompts, params, False)
    assert calls and all(r is None for r in calls)


@pytest.mark.skipif(not cpu_gemm.has_thin(), reason="no AVX512-BF16 here")
def test_the_fused_silu_gives_the_two_calls_bits(models, monkeypatch, calls):
    """gate_up's SiLU-and-mul in the thin GEMM's epilogue (dense.FUSED_SILU), in the Python loop and in the stack:
    the tokens and logprobs of dense() then silu_and_mul, on the plain weights and on their packed copies."""
    prompts, params, outs = _prompts(), _params(), {}
    for fused in (True, False):
        monkeypatch.setattr(dense, "FUSED_SILU", fused)
        for on in (False, True):  # the Python loop, then the stack: an engine each
            calls.clear()
            llm = _engine(models["qwen2"], "thin", monkeypatch)
            outs[fused, on] = _plain_then_packed(llm, prompts, params, on, calls)
    assert outs[True, False] == outs[False, False] and outs[True, True] == outs[False, True]
    assert outs[True, True] == outs[True, False]
