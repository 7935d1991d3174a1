"""The thin GEMM (kernels/cpu_gemm.c) against thin_linear_ref, and dense() handing it every bf16 linear.

Runs where the CPU has AVX512-BF16: its AMX build on Intel Sapphire Rapids and later, its vdpbf16ps build on AMD
Zen 4 and later. Elsewhere the kernel cannot execute, and only what a CPU without it must do is tested (no build,
oneDNN's copy alone)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.layers import dense
from kernels import cpu_gemm
from kernels.cpu_gemm import ThinGemm, thin_linear_ref
from tests.utils import unpacked_then_packed

needs_thin = pytest.mark.skipif(not cpu_gemm.has_thin(), reason="this CPU has no AVX512-BF16 (/proc/cpuinfo)")


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cpu-kernels")


@pytest.fixture(scope="module")
def thin(kernel_dir):
    k = ThinGemm.get(kernel_dir, wait=True)
    assert k.lib is not None, k.error
    return k


def ulps(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """|got - ref| in units of ref's bf16 spacing, less what fp32 sums in another order may differ by: a few fp32
    steps of `scale` (the sum of |x w|), which matters where a row's products cancel."""
    spacing = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(ref.float().abs().clamp_min(1e-30)))
    order = 0 if scale is None else 8 * torch.finfo(torch.float32).eps * scale
    return ((got.float() - ref.float()).abs() - order).clamp_min(0) / spacing


@needs_thin
@pytest.mark.parametrize("n, k", [(16, 32), (96, 64), (112, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_matches_its_reference(thin, n, k, bias):
    """Every row count up to past two 64-row groups (partial 16-row tiles, whole ones, a tail alone; for the dot
    build: 6-row tiles split evenly, a last group of fewer than 4 column blocks; for AMX: a thread's last group of
    one block), with and without a bias: within one bf16 step of the fp32 reference, and equal to it almost
    everywhere."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = thin.pack(w)
    for rows in (1, 2, 7, 8, 13, 15, 16, 17, 31, 32, 33, 64, 65, 130):
        x = torch.randn(rows, k, generator=g).bfloat16()
        ref, got = thin_linear_ref(x, w, b), packed(x, b)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        assert ulps(got, ref, x.float().abs() @ w.float().abs().T).max() <= 1, rows
        assert (got == ref).float().mean() > 0.97, rows
        # from the weight itself (each panel packed as it goes): the same bits
        assert torch.equal(thin.linear(x, w, b), got) and torch.equal(thin.linear(x, w, b, packed), got), rows


@needs_thin
@pytest.mark.parametrize("n, k", [(96, 64), (576, 1536), (3072, 64)])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(thin, n, k):
    """A row alone, in a decode's few rows, and in a prefill chunk of hundreds (the AMX build's row chunks: 320
    rows at K 1536; an output of over 4 MiB, which it stores past the caches): the same bits."""
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    packed = thin.pack(w)
    x = torch.randn(700, k, generator=g).bfloat16()
    whole = packed(x, b)
    assert ulps(whole, thin_linear_ref(x, w, b), x.float().abs() @ w.float().abs().T).max() <= 1
    for lo, hi in ((0, 1), (5, 6), (699, 700), (16, 48), (30, 61), (320, 340), (0, 330), (100, 700)):
        assert torch.equal(packed(x[lo:hi], b), whole[lo:hi]), (lo, hi)
    assert torch.equal(thin.linear(x, w, b), whole)


@needs_thin
def test_an_output_past_4_mib_whose_thread_shares_start_at_an_odd_block(thin):
    """The AMX build streams an output of over 4 MiB past the caches where a group's rows are whole aligned lines:
    with 34 column blocks, 2 threads' shares start at blocks 0 and 17 (a line's middle), and 3 threads' at 0, 11
    and 22. Each must still get the reference's result (a misaligned streaming store would fault)."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(544, 32, generator=g).bfloat16(), torch.randn(4000, 32, generator=g).bfloat16()
    ref, packed, threads = thin_linear_ref(x, w), thin.pack(w), torch.get_num_threads()
    try:
        for n in (2, 3):
            torch.set_num_threads(n)
            got = packed(x)
            assert ulps(got, ref, x.float().abs() @ w.float().abs().T).max() <= 1, n
            assert torch.equal(thin.linear(x, w), got), n
    finally:
        torch.set_num_threads(threads)


WIDE_K = """
import sys, torch
from pathlib import Path
from kernels.cpu_gemm import ThinGemm, thin_linear_ref
torch.set_num_threads(2)
thin = ThinGemm.get(Path(sys.argv[1]), wait=True)
for k in (576, 2560, 4096):
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(64, k, generator=g).bfloat16(), torch.randn(96, k, generator=g).bfloat16()
    got, packed = thin.pack(w)(x), thin.pack(w)
    ref = thin_linear_ref(x, w).float()
    err = ((got.float() - ref).abs() / (ref.abs() + 1)).max().item()  # within a few bf16 steps of the sum
    alone = all(torch.equal(packed(x[i : i + 1]), got[i : i + 1]) for i in (0, 31, 32, 95))
    print(k, err, alone, flush=True)
"""


@needs_thin
def test_wide_k_at_prefill_rows_on_two_threads(thin, kernel_dir):
    """K past 1024, and K whose 32-deep tiles do not divide 32 (576: 18): the AMX build stores a step's rows a few per
    K tile of the next, and once read past its 32 rows' sums there: off the top of a fresh OpenMP worker's stack at
    K 2560-4096 (the process died), inside it at 576 (ASan). In a process of its own, as a worker's first call."""
    done = subprocess.run([sys.executable, "-c", WIDE_K, str(kernel_dir)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert [r[0] for r in rows] == ["576", "2560", "4096"] and all(r[2] == "True" for r in rows), done.stdout
    assert all(float(r[1]) < 2**-6 for r in rows), done.stdout


@needs_thin
@pytest.mark.parametrize("inter, k", [(16, 32), (48, 64), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_with_silu_in_its_epilogue_is_silu_and_mul_of_the_gemm_bit_for_bit(thin, kernel_dir, inter, k, bias):
    """gemm_silu (the native stack's MLP): [gate | up] = x W^T, then SiLU-and-mul, in one pass. The bits of the GEMM
    followed by the C op it replaces, and torch's values: at every row count, on 1-3 threads (a thread's share of
    gate blocks odd or even), packed or not, with products past fp32's normal range (to_bf16's integer path) and an
    infinite input row."""
    from kernels import cpu_ops
    from kernels.activation import silu_and_mul_ref

    ops = cpu_ops.CpuOps.get(kernel_dir, wait=True).lib
    g = torch.Generator().manual_seed(inter + k)
    w = torch.randn(2 * inter, k, generator=g).bfloat16()
    b = torch.randn(2 * inter, generator=g).bfloat16() if bias else None
    packed, table, threads = thin.pack(w), cpu_ops.silu_table(), torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            for rows, scale in ((1, 1.0), (3, 1.0), (17, 1.0), (33, 1e-20), (70, 1.0), (130, 1.0)):
                x = (torch.randn(rows, k, generator=g) * scale).bfloat16()
                if rows == 70:
                    x[5, 3] = float("inf")
                gate_up = thin.linear(x, w, b, packed)
                want = cpu_ops.silu_and_mul(ops, gate_up)
                for p in (packed, None):
                    got = thin.linear(x, w, b, p, silu=table)
                    assert got.shape == (rows, inter) and torch.equal(got.view(torch.int16), want.view(torch.int16))
                torch.testing.assert_close(got, silu_and_mul_ref(gate_up), rtol=0, atol=0, equal_nan=True)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError):  # a gate block without its up block
        thin.linear(x[:, :32], torch.zeros(48, 32, dtype=torch.bfloat16), silu=table)


@needs_thin
def test_a_strided_input_and_odd_values(thin):
    """A non-contiguous x (a slice of a wider one) is read as its values; inf and NaN pass through as in the
    reference, and a zero row gives zeros."""
    w = torch.randn(32, 64).bfloat16()
    wide = torch.randn(5, 128).bfloat16()
    x = wide[:, ::2]
    x[1] = 0
    x[2, 3] = float("inf")
    x[3, 5] = float("nan")
    got, ref = thin.pack(w)(x), thin_linear_ref(x, w)
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf())
    ok = ~(ref.isnan() | ref.isinf())
    assert ulps(got[ok], ref[ok]).max() <= 1
    assert not got[1].any()


def test_which_weights_fit():
    assert cpu_gemm.fits(torch.zeros(960, 576, dtype=torch.bfloat16))
    assert not cpu_gemm.fits(torch.zeros(960, 576))  # fp32: oneDNN's
    assert not cpu_gemm.fits(torch.zeros(24, 64, dtype=torch.bfloat16))  # N not whole 16-column tiles
    assert not cpu_gemm.fits(torch.zeros(32, 48, dtype=torch.bfloat16))  # K not whole 32-deep tiles
    assert not cpu_gemm.fits(torch.zeros(32, 0, dtype=torch.bfloat16))  # no K at all (the kernel divides by it)
    assert not cpu_gemm.fits(torch.zeros(0, 32, dtype=torch.bfloat16))


@needs_thin
def test_dense_takes_the_kernel_at_every_row_count_packed_or_not(thin, monkeypatch):
    """Every bf16 linear that fits goes to the kernel, whatever its rows: on the weight itself before
    packing, on the one copy pack() makes after (no oneDNN copy), with the same bits; a weight that does not fit and
    fp32 stay with F.linear."""
    monkeypatch.setattr(ThinGemm, "loaded", classmethod(lambda cls: thin))
    calls = []
    linear = ThinGemm.linear
    monkeypatch.setattr(ThinGemm, "linear", lambda self, x, w, b=None, p=None: calls.append((len(x), p is not None))
                        or linear(self, x, w, b, p))  # fmt: skip
    w = torch.nn.Parameter(torch.randn(96, 64, dtype=torch.bfloat16), requires_grad=False)
    xs = [torch.randn(rows, 64, dtype=torch.bfloat16) for rows in (1, 16, 65, 300)]
    before = [dense.dense(x, w) for x in xs]
    assert dense.pack([w]) == w.numel() * 2 and getattr(w, dense.PACKED, None) is None
    after = [dense.dense(x, w) for x in xs]
    assert calls == [(1, False), (16, False), (65, False), (300, False), (1, True), (16, True), (65, True), (300, True)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    odd = torch.randn(24, 64, dtype=torch.bfloat16)  # N not whole 16-column blocks
    dense.dense(xs[0], odd)
    dense.dense(torch.randn(3, 64), w.float())
    assert len(calls) == 8


@needs_thin
def test_the_kernels_linear_refuses_what_its_c_would_misread(thin):
    """x must be a bf16 [M, K] host tensor and w a weight that fits: anything else is a ValueError, not misread."""
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    for bad_x, bad_w in ((x.float(), w), (x.half(), w), (x[None], w), (x[0], w), (x, w[:24]), (x[:, :32], w)):
        with pytest.raises(ValueError):
            thin.linear(bad_x, bad_w)
    with pytest.raises(ValueError):
        thin.linear(x, w, torch.zeros(31))
    packed = thin.pack(w)
    for bad_x, bias in ((x.float(), None), (x[:, :32], None), (x[None], None), (x, torch.zeros(31))):
        with pytest.raises(ValueError):
            packed(bad_x, bias)
    assert torch.equal(thin.linear(x, w), packed(x))


def test_without_avx512_bf16_nothing_is_built_and_weights_get_onednns_copy_alone(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw"})
    monkeypatch.setattr(ThinGemm, "_all", {})
    assert ThinGemm.get(tmp_path) is None and ThinGemm.loaded() is None
    assert not list(tmp_path.iterdir())  # nothing compiled
    w = torch.nn.Parameter(torch.randn(32, 64, dtype=torch.bfloat16), requires_grad=False)
    dense.pack([w])
    assert getattr(w, dense.THIN, None) is None


@needs_thin
def test_an_engine_on_avx512_bf16_packs_its_copies_and_keeps_its_tokens(tiny_llama):
    """bf16 greedy with the thin GEMM's copies gives the tokens and logprobs, bit for bit, it gave before packing
    (every row count on the kernel, packed or not)."""
    from engine import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), device="cpu", dtype="bfloat16", kv_cache_memory=8 << 20, log_stats_interval=0)
    model = llm.engine.runner.model
    assert ThinGemm.current() is not None and ThinGemm.current().wait()
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
    first, second = unpacked_then_packed(llm, params)
    assert all(hasattr(getattr(layer, n), dense.THIN) for layer in model.layers for n in layer.LINEARS)
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert x == y
