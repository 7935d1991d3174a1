"""The AVX2 thin GEMM (kernels/cpu_thin_avx2.c) against thin_linear_ref, and dense() handing it a decode's few rows
where oneDNN has no bf16 GEMM (forced here on every CPU with AVX2 and FMA: the kernel runs on any of them)."""

from __future__ import annotations

import pytest
import torch

from engine.layers import dense
from kernels import cpu_gemm

needs_avx2 = pytest.mark.skipif(not cpu_gemm.has_avx2(), reason="this CPU has no AVX2 and FMA (/proc/cpuinfo)")
pytestmark = needs_avx2


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = cpu_gemm.Avx2Gemm.get(tmp_path_factory.mktemp("cpu-kernels"), wait=True)
    assert k is not None and k.lib is not None, k and k.error
    return k


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one bf16 step of the fp32 reference (the sums' order differs from MKL's)."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize("n,k", [(16, 8), (48, 100), (96, 64), (576, 576), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_matches_the_reference(kernel, n, k, bias):
    torch.manual_seed(n + k)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    packed = kernel.pack(w)
    for rows in (1, 2, 3, 4, 5, 7, 8, 13, 16, 33):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        _close(packed(x, b), cpu_gemm.thin_linear_ref(x, w, b))


def test_strided_rows_inf_and_nan(kernel):
    w = torch.randn(32, 40, dtype=torch.bfloat16)
    packed = kernel.pack(w)
    x = torch.randn(6, 80, dtype=torch.bfloat16)[:, ::2]  # not contiguous
    _close(packed(x), cpu_gemm.thin_linear_ref(x, w))
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    x[1, 5], x[2, 7] = float("inf"), float("nan")
    got, want = packed(x), cpu_gemm.thin_linear_ref(x, w)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    _close(got[0:1], want[0:1])


def test_dense_takes_it_for_a_decodes_rows_only(kernel, monkeypatch):
    monkeypatch.setattr(dense, "onednn_bf16", lambda: False)
    monkeypatch.setattr(cpu_gemm.Avx2Gemm, "loaded", classmethod(lambda cls: kernel))
    w = torch.nn.Parameter(torch.randn(64, 48, dtype=torch.bfloat16), requires_grad=False)
    assert dense.pack([w]) == w.numel() * (4 + 2)  # the fp32 copy and the kernel's
    calls = []
    real = cpu_gemm.ThinWeight.__call__
    monkeypatch.setattr(
        cpu_gemm.ThinWeight, "__call__", lambda self, x, b=None: calls.append(len(x)) or real(self, x, b)
    )
    top = cpu_gemm.AVX2_ROWS
    for rows in (1, 16, top, top + 1, 200):
        x = torch.randn(rows, 48, dtype=torch.bfloat16)
        _close(dense.dense(x, w), cpu_gemm.thin_linear_ref(x, w))
    assert calls == [1, 16, top]  # past AVX2_ROWS: MKL's fp32 GEMM on the fp32 copy
    odd = torch.nn.Parameter(torch.randn(40, 48, dtype=torch.bfloat16), requires_grad=False)
    assert dense.pack([odd]) == odd.numel() * 4 and not hasattr(odd, dense.THIN)  # N not a multiple of 16


def test_an_engine_decodes_through_it_with_its_tokens(tiny_llama, monkeypatch):
    """bf16 greedy through the kernel's copies gives the tokens it gave before packing; logprobs within bf16's
    rounding of the sampled tokens."""
    from engine import LLM, SamplingParams

    monkeypatch.setattr(dense, "onednn_bf16", lambda: False)
    monkeypatch.setattr(cpu_gemm, "has_amx", lambda: False)  # an AMX CPU would start its own kernel first
    monkeypatch.setattr(cpu_gemm.ThinGemm, "loaded", classmethod(lambda cls: None))
    llm = LLM(model=str(tiny_llama), dtype="bfloat16", kv_cache_memory=8 << 20, log_stats_interval=0)
    assert cpu_gemm.Avx2Gemm.current() is not None and cpu_gemm.Avx2Gemm.current().wait()
    idle, model = llm.engine.idle, llm.engine.runner.model
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 20)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    idle.pack, pending = [], idle.pack
    first = llm.generate(prompts, params)
    idle.pack = pending
    second = llm.generate(prompts, params)
    assert all(hasattr(getattr(layer, n), dense.THIN) for layer in model.layers for n in layer.LINEARS)
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for tok, x, y in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(x[tok] - y[tok]) < 0.05
