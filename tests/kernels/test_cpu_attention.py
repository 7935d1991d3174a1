"""CPU decode attention in C (kernels/cpu_attention.c) against paged_attention_ref, on decode batches whose unused
KV slots are NaN (a read past a sequence's context poisons its output), and the build: cached per CPU and head_dim,
shared by the process, and a missing compiler leaves the torch path with the reason logged. Built for real with
this machine's C compiler (the project's machines have gcc, as Triton needs)."""

import logging

import pytest
import torch

from engine.layers.attention import StepLayout, TorchAttention
from kernels import cpu_build
from kernels.cpu_attention import NativeDecode, paged_decode_cpu
from kernels.paged_attention import paged_attention_ref
from tests.kernels.conftest import TOL, assert_close
from tests.kernels.test_paged_attention import FP8, FP8_TOL, make_batch

pytestmark = pytest.mark.filterwarnings("ignore")

# (1 query token, context): partial blocks, a 1-token context, several blocks
DECODES = [(1, 7), (1, 1), (1, 16), (1, 30), (1, 3)]


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cpu-kernels")


def kernel(d, kernel_dir):
    k = NativeDecode.get(d, kernel_dir, wait=True)
    assert k is not None and k.lib is not None, k and k.error
    return k


def check(args, kernel_dir, tol=None, **kw):
    args = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    ref = paged_attention_ref(**args, **kw)
    a = {k: v for k, v in args.items() if k != "query_start_loc"}
    out = paged_decode_cpu(**a, **kw, kernel=kernel(args["q"].shape[-1], kernel_dir))
    assert out.dtype == args["q"].dtype and out.shape == args["q"].shape
    assert torch.isfinite(ref).all() and torch.isfinite(out).all(), "NaN from an unused KV slot"
    assert_close(out, ref, "cpu decode attention", **(tol or TOL[args["q"].dtype]))


@pytest.mark.parametrize("h,kvh", [(4, 2), (4, 1), (2, 2), (9, 3)], ids=["gqa", "mqa", "mha", "rep3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_decodes_match_the_reference(h, kvh, dtype, kernel_dir):
    check(make_batch(DECODES, h=h, kvh=kvh, dtype=dtype, seed=h), kernel_dir)


@pytest.mark.parametrize("d,bs", [(8, 4), (48, 8), (64, 16), (128, 8)])
def test_head_dims_and_block_sizes(d, bs, kernel_dir):
    check(make_batch(DECODES, d=d, bs=bs, seed=d), kernel_dir)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_kv(dtype, kernel_dir):
    args = make_batch(DECODES, dtype=dtype, kv_dtype=FP8, seed=5)
    assert torch.isnan(args["k_cache"].float()).any()  # the poison survives the fp8 cast
    check(args, kernel_dir, FP8_TOL)


def test_sliding_window_and_soft_cap(kernel_dir):
    args = make_batch(DECODES, seed=9)
    check(args, kernel_dir, window=5)
    check(args, kernel_dir, softcap=2.0)
    check(args, kernel_dir, window=4, softcap=3.0)


def test_a_long_context_matches(kernel_dir):
    check(make_batch([(1, 700), (1, 257)], h=6, kvh=2, d=64, bs=16, dtype=torch.bfloat16, seed=2), kernel_dir)


def test_the_engines_torch_backend_gives_the_same_output_with_and_without_it(kernel_dir):
    """TorchAttention's decodes through the kernel (one call per layer, no buckets) against its gather path."""
    spec = [(1, 7), (1, 40), (1, 1), (5, 14), (1, 23)]  # a prefill chunk rides along on the gather path
    batch = make_batch(spec, seed=4, poison=False)  # the gather path multiplies its pads by 0: NaN there would leak
    args = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    kvh, _, bs, d = args["k_cache"].shape
    qsl = args["query_start_loc"].tolist()
    tables = [args["block_tables"][i, : -(-ctx // bs)].tolist() for i, (_, ctx) in enumerate(spec)]
    layout = StepLayout(torch.zeros(0, dtype=torch.long), qsl, [c for _, c in spec], tables)
    none = torch.zeros(0, kvh, d)
    outs = []
    for native in (None, kernel(d, kernel_dir)):
        attn = TorchAttention(bs, args["scale"])
        attn.native = native
        meta = attn.build(layout, torch.device("cpu"))
        assert (meta.native is not None) == (native is not None)
        outs.append(attn.forward(args["q"], none, none, args["k_cache"], args["v_cache"], meta))
    assert_close(outs[1], outs[0], "native vs gather")


def test_a_build_is_cached_and_shared(kernel_dir, monkeypatch):
    monkeypatch.setattr(NativeDecode, "_all", {})  # an earlier test in this process may hold one from elsewhere
    first = kernel(64, kernel_dir)
    assert NativeDecode.get(64, kernel_dir / "elsewhere") is first  # one per head_dim in a process
    cc = cpu_build.compiler()
    path = cpu_build.library_path(kernel_dir, NativeDecode.SOURCE, ("-DHEAD_DIM=64",), cc)
    mtime = path.stat().st_mtime_ns
    assert cpu_build.build(kernel_dir, NativeDecode.SOURCE, ("-DHEAD_DIM=64",)) == path
    assert path.stat().st_mtime_ns == mtime  # not built again
    assert NativeDecode.get(20, kernel_dir) is None  # head_dim 20: not a multiple of 8


def test_without_a_compiler_decodes_keep_the_torch_path_and_the_log_says_why(kernel_dir, monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    monkeypatch.setattr(NativeDecode, "_all", {})
    with caplog.at_level(logging.WARNING, logger="engine"):
        k = NativeDecode.get(64, kernel_dir, wait=True)
    assert k.lib is None and "no C compiler" in k.error
    assert "native kernel unavailable, decodes take the torch path: no C compiler" in caplog.text
    attn = TorchAttention(16, 0.125)
    attn.native = k
    layout = StepLayout(torch.zeros(0, dtype=torch.long), [0, 1], [5], [[0]])
    assert attn.build(layout, torch.device("cpu")).native is None


def test_a_failed_compile_names_the_compilers_message(kernel_dir, monkeypatch):
    monkeypatch.setattr(cpu_build, "FLAGS", (*cpu_build.FLAGS, "-include", "/nonexistent.h"))
    with pytest.raises(RuntimeError, match="nonexistent.h"):
        cpu_build.build(kernel_dir, NativeDecode.SOURCE, ("-DHEAD_DIM=32",))


def test_sinks(kernel_dir):
    """GPT-OSS's sinks (a logit per query head in each softmax's denominator, no value), with and without a window;
    large ones change the output, so a kernel that ignored them would fail."""
    args = make_batch(DECODES, h=4, kvh=2, seed=11)
    check(args, kernel_dir, sinks=torch.randn(4) * 2)
    check(args, kernel_dir, window=4, sinks=torch.randn(4))
    a = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items() if k != "query_start_loc"}
    plain = paged_decode_cpu(**a, kernel=kernel(a["q"].shape[-1], kernel_dir))
    sunk = paged_decode_cpu(**a, sinks=torch.full((4,), 6.0), kernel=kernel(a["q"].shape[-1], kernel_dir))
    assert (plain - sunk).abs().max() > 0.1
