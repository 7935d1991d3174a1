"""The AVX2 GEMM (kernels/cpu_gemm_avx2.c) against thin_linear_ref, its one summation order (a row's result bit for
bit the same at every row count, next to any rows, on any thread count, from the weight or its packed copy), and
dense() running every bf16 linear through it where oneDNN has no bf16 GEMM (forced here on every CPU with AVX2 and
FMA: the kernel runs on any of them), so a greedy request's logprobs do not depend on the batch, a prefix-cache hit,
or whether IdleWork has packed the weights yet."""

from __future__ import annotations

import pytest
import torch

from engine.layers import dense
from kernels import cpu_gemm
from tests.utils import unpacked_then_packed

needs_avx2 = pytest.mark.skipif(not cpu_gemm.has_avx2(), reason="this CPU has no AVX2 and FMA (/proc/cpuinfo)")
pytestmark = needs_avx2


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = cpu_gemm.Avx2Gemm.get(tmp_path_factory.mktemp("cpu-kernels"), wait=True)
    assert k is not None and k.lib is not None, k and k.error
    return k


@pytest.fixture
def no_onednn(kernel, monkeypatch):
    """dense() as on a CPU without oneDNN's bf16 GEMM, with the kernel loaded."""
    monkeypatch.setattr(dense, "onednn_bf16", lambda: False)
    monkeypatch.setattr(cpu_gemm.Avx2Gemm, "loaded", classmethod(lambda cls: kernel))
    return kernel


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one bf16 step of the fp32 reference (the sums' order differs from MKL's)."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize("n,k", [(1, 8), (16, 13), (17, 100), (96, 64), (576, 576), (200, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_matches_the_reference_packed_or_not(kernel, n, k, bias):
    """N not a multiple of a panel's 16 columns, K not of the packing's 8-step transposes, rows not of a tile's 6;
    the packed weight and the one packed panel by panel as the kernel goes give the same bits."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    packed = kernel.pack(w)
    col = torch.arange(16)  # a K step's word j holds column j, then column j + 8
    columns = packed[:, :, torch.where(col < 8, 2 * col, 2 * (col - 8) + 1)].transpose(1, 2).reshape(-1, k)
    assert torch.equal(columns[:n], w) and not columns[n:].any()  # zeros past N
    for rows in (1, 2, 3, 4, 5, 6, 7, 12, 13, 31, 32, 33, 130):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        got = kernel.linear(x, w, b, packed)
        _close(got, cpu_gemm.thin_linear_ref(x, w, b))
        assert torch.equal(kernel.linear(x, w, b), got), rows


@pytest.mark.parametrize("n,k", [(7, 13), (96, 64), (1536, 576), (576, 1540)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel, n, k):
    """Every slice of a 300-row batch gives those rows of the whole batch's result, bit for bit: decode's few rows
    and a prefill's many (in row chunks) alike, from the packed weight or not, and on 1 thread as on all."""
    torch.manual_seed(k)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16)
    x = torch.randn(300, k, dtype=torch.bfloat16)
    packed = kernel.pack(w)
    whole = kernel.linear(x, w, b)
    for rows in (1, 2, 3, 5, 16, 31, 32, 33, 64, 257, 299):
        for start in (0, 1, 300 - rows):
            want = whole[start : start + rows]
            assert torch.equal(kernel.linear(x[start : start + rows], w, b), want), (rows, start)
            assert torch.equal(kernel.linear(x[start : start + rows], w, b, packed), want), (rows, start)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel.linear(x, w, b), whole) and torch.equal(kernel.linear(x[:3], w, b), whole[:3])
        assert torch.equal(kernel.linear(x, w, b, packed), whole)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows_empty_misfits_inf_and_nan(kernel):
    w = torch.randn(32, 40, dtype=torch.bfloat16)
    x = torch.randn(6, 80, dtype=torch.bfloat16)[:, ::2]  # not contiguous
    _close(kernel.linear(x, w), cpu_gemm.thin_linear_ref(x, w))
    x = torch.randn(40, 80, dtype=torch.bfloat16)[:, :40]  # rows at a stride of 80
    _close(kernel.linear(x, w), cpu_gemm.thin_linear_ref(x, w))
    assert kernel.linear(torch.empty(0, 40, dtype=torch.bfloat16), w).shape == (0, 32)
    with pytest.raises(ValueError, match="do not fit"):  # as F.linear refuses them, not a read past the weight
        kernel.linear(torch.randn(2, 41, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="do not fit"):
        kernel.linear(torch.randn(2, 40, dtype=torch.bfloat16), w, torch.randn(31))
    with pytest.raises(ValueError, match="is not weight"):  # another weight's panels, or not panels at all
        kernel.linear(torch.randn(2, 40, dtype=torch.bfloat16), w, None, kernel.pack(w[:16]))
    with pytest.raises(ValueError, match="is not weight"):
        kernel.linear(torch.randn(2, 40, dtype=torch.bfloat16), w, None, kernel.pack(w).float())
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    x[1, 5], x[2, 7] = float("inf"), float("nan")
    got, want = kernel.linear(x, w), cpu_gemm.thin_linear_ref(x, w)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    _close(got[0:1], want[0:1])


def test_dense_runs_every_bf16_row_count_through_it_packed_or_not(no_onednn, monkeypatch, caplog):
    w = torch.nn.Parameter(torch.randn(64, 48, dtype=torch.bfloat16), requires_grad=False)
    calls = []
    real = cpu_gemm.Avx2Gemm.linear
    monkeypatch.setattr(
        cpu_gemm.Avx2Gemm,
        "linear",
        lambda self, x, w, b=None, p=None: calls.append((len(x), p is not None)) or real(self, x, w, b, p),
    )
    xs = [torch.randn(rows, 48, dtype=torch.bfloat16) for rows in (1, 16, 17, 200, 2048)]
    before = [dense.dense(x, w) for x in xs]
    for x, y in zip(xs, before):
        _close(y, cpu_gemm.thin_linear_ref(x, w))
    assert calls == [(1, False), (16, False), (17, False), (200, False), (2048, False)]
    dense.dense(torch.randn(3, 48), w.float())  # fp32 stays with MKL's F.linear
    assert len(calls) == 5
    # packing (IdleWork's pieces): memory checked as for oneDNN's copies, then the panels, the same bits
    assert dense.packable(w) and not dense.packable(w.float())
    with caplog.at_level("WARNING", logger="engine"):
        assert dense.pack([w], room=lambda: dense.PACK_HEADROOM + w.numel() * 2 - 1) == 0
    assert "CPU weight packing stopped" in caplog.text and not hasattr(w, dense.AVX2_PACKED)
    assert dense.pack([w], room=lambda: None) == w.numel() * 2 and not dense.packable(w)
    assert not hasattr(w, dense.PACKED) and not hasattr(w, dense.THIN)  # nothing of oneDNN's
    calls.clear()
    assert all(torch.equal(dense.dense(x, w), y) for x, y in zip(xs, before))
    assert calls == [(1, True), (16, True), (17, True), (200, True), (2048, True)]
    # without the kernel (no compiler): MKL's fp32 GEMM on the weight widened per call past 16 rows
    monkeypatch.setattr(dense, "AVX2", False)
    x = torch.randn(17, 48, dtype=torch.bfloat16)
    assert torch.equal(dense.dense(x, w), torch.nn.functional.linear(x.float(), w.float()).bfloat16())
    assert len(calls) == 5 and not dense.packable(torch.randn(4, 4, dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory):
    """A random 2-layer Llama with SmolLM2-135M's linear shapes (576 wide, 1536 MLP, 9 heads, 3 KV heads): at the
    tiny models' 96 wide, MKL's sums happened to match torch's bf16 ones, and the test below could not fail."""
    from tests.utils import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("smollm2-shaped") / "m", "llama", hidden_size=576,
                            intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)  # fmt: skip


def test_an_engines_greedy_logprobs_do_not_depend_on_the_batch_or_the_prefix_cache(smollm2_shaped, no_onednn,
                                                                                   monkeypatch):  # fmt: skip
    """A request alone, beside others, and again after its prompt's blocks were cached (its prefill then has a
    few rows where it had many): the same tokens and logprobs, bit for bit. With dense.AVX2 off (MKL's fp32 GEMM
    past 16 rows, torch's bf16 GEMM below, as before this kernel ran every row count) the logprobs differed, for 6
    prompts of 6; on SmolLM2 itself its near ties flipped (three whole-vs-streamed server tests, an AVX2 EPYC)."""
    from engine import LLM, SamplingParams

    monkeypatch.setattr(cpu_gemm, "has_thin", lambda: False)  # an AVX512-BF16 CPU would start the thin GEMM
    monkeypatch.setattr(cpu_gemm.ThinGemm, "loaded", classmethod(lambda cls: None))
    llm = LLM(model=str(smollm2_shaped), device="cpu", dtype="bfloat16", kv_cache_memory=16 << 20, log_stats_interval=0,
              enable_prefix_caching=True)  # fmt: skip
    model = llm.engine.runner.model
    assert len(llm.engine.idle.pack) == len(model.layers) + 1  # the AVX2 panels: a layer a piece, then the head
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    first, second = unpacked_then_packed(llm, params)  # before and after IdleWork packed the weights: the same bits
    assert all(hasattr(getattr(layer, n), dense.AVX2_PACKED) for layer in model.layers for n in layer.LINEARS)
    for a, b in zip(first, second):
        assert (a.outputs[0].token_ids, a.outputs[0].logprobs) == (b.outputs[0].token_ids, b.outputs[0].logprobs)
    prompt = {"prompt_token_ids": [(7 * i) % 300 + 5 for i in range(45)]}  # 2 whole blocks of 16, and 13 rows
    others = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 20)]
    alone = llm.generate([prompt], params)[0]
    beside = llm.generate([others[0], prompt, others[1]], params)[1]  # cached now: 13 rows, with others
    again = llm.generate([prompt], params)[0]
    assert alone.metrics.cached_prompt_tokens == 0 and beside.metrics.cached_prompt_tokens == 32
    for got in (beside, again):
        assert got.outputs[0].token_ids == alone.outputs[0].token_ids
        assert got.outputs[0].logprobs == alone.outputs[0].logprobs
