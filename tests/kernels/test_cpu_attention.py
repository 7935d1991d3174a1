"""CPU attention in C (kernels/cpu_attention.c) against paged_attention_ref, on decode batches and on varlen batches
of prefill chunks and decodes, whose unused KV slots are NaN (a read past a sequence's context poisons its output);
one summation order per query token whatever shares its call; and the build: cached per CPU and head_dim, shared by
the process, and a missing compiler leaves the torch path with the reason logged. Built for real with this
machine's C compiler (the project's machines have gcc, as Triton needs)."""

import logging

import pytest
import torch

from engine.layers import attention
from engine.layers.attention import StepLayout, TorchAttention
from kernels import cpu_build
from kernels.cpu_attention import NativeAttention, paged_attention_cpu
from kernels.paged_attention import paged_attention_ref
from tests.kernels.conftest import P_ROUNDED_TOL, TOL, assert_close
from tests.kernels.test_paged_attention import FP8, FP8_TOL, make_batch

pytestmark = pytest.mark.filterwarnings("ignore")

# (query tokens, context): partial blocks, a 1-token context, several blocks
DECODES = [(1, 7), (1, 1), (1, 16), (1, 30), (1, 3)]
# prefill chunks (a whole prompt, one after earlier context, one past a kernel item's 16 tokens) among decodes
MIXED = [(5, 14), (1, 7), (20, 20), (3, 40), (1, 1), (33, 33), (2, 2)]


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cpu-kernels")


def kernel(d, kernel_dir):
    k = NativeAttention.get(d, kernel_dir, wait=True)
    assert k is not None and k.lib is not None, k and k.error
    return k


def cpu(batch: dict) -> dict:
    """make_batch's tensors on the CPU (they are on KERNEL_TEST_DEVICE, cuda in the GPU check): this kernel's home."""
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def check(args, kernel_dir, tol=None, **kw):
    args = cpu(args)
    ref = paged_attention_ref(**args, **kw)
    k = kernel(args["q"].shape[-1], kernel_dir)
    out = paged_attention_cpu(**args, **kw, kernel=k)
    assert out.dtype == args["q"].dtype and out.shape == args["q"].shape
    assert torch.isfinite(ref).all() and torch.isfinite(out).all(), "NaN from an unused KV slot"
    assert_close(out, ref, "cpu attention", **(tol or tolerance(k, args)))


def tolerance(k, args) -> dict:
    """TOL for q's dtype; where the build rounds the softmax's weights to bf16 (AVX512-BF16, a bf16 q on a bf16
    cache), flash attention's wider bound (tests/kernels/conftest.py)."""
    rounded = k.rounds_weights and args["q"].dtype == torch.bfloat16 and args["k_cache"].dtype == torch.bfloat16
    return P_ROUNDED_TOL if rounded else TOL[args["q"].dtype]


@pytest.mark.parametrize("batch", [DECODES, MIXED], ids=["decodes", "mixed"])
@pytest.mark.parametrize("h,kvh", [(4, 2), (4, 1), (2, 2), (9, 3)], ids=["gqa", "mqa", "mha", "rep3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_batches_match_the_reference(batch, h, kvh, dtype, kernel_dir):
    check(make_batch(batch, h=h, kvh=kvh, dtype=dtype, seed=h), kernel_dir)


@pytest.mark.parametrize("d,bs", [(8, 4), (48, 8), (64, 16), (128, 8), (96, 5)])
def test_head_dims_and_block_sizes(d, bs, kernel_dir):
    check(make_batch(MIXED, d=d, bs=bs, seed=d), kernel_dir)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_kv(dtype, kernel_dir):
    args = make_batch(MIXED, dtype=dtype, kv_dtype=FP8, seed=5)
    assert torch.isnan(args["k_cache"].float()).any()  # the poison survives the fp8 cast
    check(args, kernel_dir, FP8_TOL)
    # a scale per kv head (each tensor-parallel rank calibrates its own heads: a TP=1 reference holds them all)
    per_head = {"k_scale": torch.tensor([0.05, 0.2]).view(2, 1, 1), "v_scale": torch.tensor([0.03, 0.01]).view(2, 1, 1)}
    check({**args, **per_head}, kernel_dir, FP8_TOL)


@pytest.mark.parametrize("batch", [DECODES, MIXED], ids=["decodes", "mixed"])
def test_sliding_window_and_soft_cap(batch, kernel_dir):
    args = make_batch(batch, seed=9)
    check(args, kernel_dir, window=5)
    check(args, kernel_dir, window=17)  # a window wider than an item's 16 tokens, narrower than the chunk
    check(args, kernel_dir, softcap=2.0)
    check(args, kernel_dir, window=4, softcap=3.0)


def test_a_long_context_matches(kernel_dir):
    """A 300-token chunk after 400 tokens of context (many items, scores past an L2's worth) and a long decode."""
    check(make_batch([(300, 700), (1, 257)], h=6, kvh=2, d=64, bs=16, dtype=torch.bfloat16, seed=2), kernel_dir)


@pytest.mark.parametrize("h,kvh", [(9, 3), (4, 2), (3, 3)], ids=["rep3", "rep2", "rep1"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_tokens_output_is_the_same_whatever_shares_its_call(dtype, window, h, kvh, kernel_dir):
    """Tokens of a 41-token sequence, bit for bit: from a whole-prompt prefill, a chunk after a prefix-cache hit, a
    chunk of 2, a decode, beside other sequences, and on 1 thread as on 2. (Its scores, softmax and weighted sum run
    in one order whatever tokens share its kernel item: streamed and whole answers agree.) A bf16 decode's 1-3 rows
    take the kernel's `direct` path (the cache read in place), the prefill's the fp32 copy: the bits agree."""
    whole = cpu(make_batch([(41, 41)], h=h, kvh=kvh, d=64, bs=16, dtype=dtype, seed=3, poison=False))
    k = kernel(64, kernel_dir)
    ref = paged_attention_cpu(**whole, window=window, kernel=k)
    assert_close(
        ref, paged_attention_ref(**whole, window=window), "whole prefill vs the reference", **tolerance(k, whole)
    )

    def token(t, nq, others=(), threads=None):
        """Token t's output with the sequence cut to its first t + 1 tokens, the last nq of them queried (after
        others' sequences)."""
        b = cpu(make_batch([*others, (nq, t + 1)], h=h, kvh=kvh, d=64, bs=16, dtype=dtype, seed=7, poison=False))
        n = -(-(t + 1) // 16)  # its blocks: K, V and queries copied in from `whole`
        for c in ("k_cache", "v_cache"):
            b[c][:, b["block_tables"][-1, :n].long()] = whole[c][:, whole["block_tables"][0, :n].long()]
        b["q"][-nq:] = whole["q"][t + 1 - nq : t + 1]
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        try:
            return paged_attention_cpu(**b, window=window, kernel=k)[-1]
        finally:
            torch.set_num_threads(before)

    for t, nq, others, threads in [(40, 5, (), None), (40, 2, (), None), (40, 1, (), None), (10, 1, (), None),
                                   (3, 1, [(1, 9), (20, 20)], None), (20, 17, [(3, 30)], None), (0, 1, (), None),
                                   (40, 41, (), 1), (16, 1, (), 1)]:  # fmt: skip
        assert torch.equal(token(t, nq, others, threads), ref[t]), (t, nq, others, threads)


@pytest.mark.parametrize("d,dtype", [(72, torch.float32), (72, torch.bfloat16), (128, torch.bfloat16)], ids=str)
def test_a_tokens_bits_hold_at_other_head_dims_with_a_soft_cap(d, dtype, kernel_dir):
    """Each token of a 45-token prompt, bit for bit, from the whole prompt, a decode and chunks of 2, 5 and 17, with a
    soft cap and GQA 8. head_dim 72 takes the fp32 path on every CPU (no 32-wide bf16 pairs; GCC once contracted its
    multiply-adds into FMAs in some loop copies and not others: an ulp apart here); 128 in bf16 the AVX512-BF16 path
    where the CPU has it (two 64-wide passes of the weighted sum)."""
    b = cpu(make_batch([(45, 45)], h=8, kvh=1, d=d, bs=16, dtype=dtype, seed=81, poison=True))
    k = kernel(d, kernel_dir)
    whole = paged_attention_cpu(**b, softcap=2.5, kernel=k)
    for t in range(0, 45, 4):
        for nq in {1, 2, 5, 17, t + 1}:
            if nq > t + 1:
                continue
            seq = {"seq_lens": torch.tensor([t + 1], dtype=torch.int32), "block_tables": b["block_tables"][:1],
                   "query_start_loc": torch.tensor([0, nq], dtype=torch.int32)}  # fmt: skip
            part = paged_attention_cpu(**{**b, **seq, "q": b["q"][t + 1 - nq : t + 1]}, softcap=2.5, kernel=k)
            assert torch.equal(part[-1], whole[t]), (t, nq)


@pytest.mark.parametrize("prefill", [True, False], ids=["all", "decodes-only"])
def test_the_engines_torch_backend_gives_the_same_output_with_and_without_it(prefill, kernel_dir, monkeypatch):
    """TorchAttention's whole step through the kernel (one call per layer, no buckets) against its gather and SDPA
    path; with NATIVE_PREFILL off (bench's --ab native-prefill), its decodes alone, the prefill chunks on SDPA."""
    monkeypatch.setattr(attention, "NATIVE_PREFILL", prefill)
    spec = [(1, 7), (1, 40), (1, 1), (5, 14), (1, 23), (9, 12)]  # two chunks after earlier context
    batch = make_batch(spec, seed=4, poison=False)  # the gather path multiplies its pads by 0: NaN there would leak
    args = cpu(batch)
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
        assert native is None or (meta.native.rows is None) == prefill and len(meta.prefills) == 2 * (not prefill)
        outs.append(attn.forward(args["q"], none, none, args["k_cache"], args["v_cache"], meta))
    assert_close(outs[1], outs[0], "native vs gather")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_steps_new_rows_are_written_by_the_call_that_reads_them(dtype, kernel_dir):
    """q, k and v as the engine hands them (views of each token's fused qkv row): the kernel writes k and v at their
    slots before it reads, giving the caches and the output of reshape_and_cache_ref then a call on a contiguous q,
    bit for bit; a -1 slot (padding) writes nothing. A slot past the pool, rows of another shape and an fp8 cache
    (torch quantizes its rows) are refused."""
    from kernels.cache_write import reshape_and_cache_ref

    spec, h, kvh, d, bs = [(5, 14), (1, 7), (3, 3)], 9, 3, 64, 16
    args = cpu(make_batch(spec, h=h, kvh=kvh, d=d, bs=bs, dtype=dtype, seed=5, poison=False))
    tables = args["block_tables"]
    slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs for i, (nq, ctx) in enumerate(spec)
                          for p in range(ctx - nq, ctx)])  # fmt: skip
    slots[6] = -1  # the decode's row: its cache slot keeps what it held
    qkv = torch.randn(len(slots), (h + 2 * kvh) * d).to(dtype)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(-1, h, d), k.view(-1, kvh, d), v.view(-1, kvh, d)
    assert q.stride(0) == qkv.shape[1] and not q.is_contiguous()
    want_k, want_v = args["k_cache"].clone(), args["v_cache"].clone()
    reshape_and_cache_ref(k, v, want_k, want_v, slots)
    nat = kernel(d, kernel_dir)
    call = (tables, args["seq_lens"], args["query_start_loc"], args["scale"])
    want = nat(q.contiguous(), want_k, want_v, *call)
    got = nat(q, args["k_cache"], args["v_cache"], *call, k=k, v=v, slots=slots)
    assert torch.equal(args["k_cache"], want_k) and torch.equal(args["v_cache"], want_v)
    assert got.dtype == dtype and torch.equal(got, want)
    assert_close(got, paged_attention_ref(**{**args, "q": q.contiguous(), "k_cache": want_k, "v_cache": want_v}),
                 "written and read in one call", **tolerance(nat, args))  # fmt: skip
    nb = args["k_cache"].shape[1]
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match="slot past the cache"):  # refused, not written past the pool
        nat(q, args["k_cache"], args["v_cache"], *call, k=k, v=v, slots=slots.clamp(min=0) + nb * bs)
    assert torch.equal(args["k_cache"], before)
    with pytest.raises(ValueError, match="new rows"):  # rows of another head count: not read as these
        nat(q, args["k_cache"], args["v_cache"], *call, k=k[:, :2], v=v[:, :2], slots=slots)
    fp8 = cpu(make_batch(spec, h=h, kvh=kvh, d=d, bs=bs, kv_dtype=FP8, seed=5))
    with pytest.raises(ValueError, match="not fp8"):
        nat(q, fp8["k_cache"], fp8["v_cache"], *call, k=k.to(FP8), v=v.to(FP8), slots=slots)


def test_tensors_off_the_cpu_are_refused_not_read(kernel_dir):
    """A device pointer handed to C would be read as host memory (a segfault): the wrapper names what is elsewhere."""
    args = cpu(make_batch([(3, 5)], seed=1))
    args["k_cache"] = args["k_cache"].to("meta")
    with pytest.raises(ValueError, match="k_cache on meta"):
        paged_attention_cpu(**args, kernel=kernel(args["q"].shape[-1], kernel_dir))


def test_a_build_is_cached_and_shared(kernel_dir, monkeypatch):
    monkeypatch.setattr(NativeAttention, "_all", {})  # an earlier test in this process may hold one from elsewhere
    first = kernel(64, kernel_dir)
    assert NativeAttention.get(64, kernel_dir / "elsewhere") is first  # one per head_dim in a process
    cc = cpu_build.compiler()
    path = cpu_build.library_path(kernel_dir, NativeAttention.SOURCE, ("-DHEAD_DIM=64",), cc)
    mtime = path.stat().st_mtime_ns
    assert cpu_build.build(kernel_dir, NativeAttention.SOURCE, ("-DHEAD_DIM=64",)) == path
    assert path.stat().st_mtime_ns == mtime  # not built again
    assert NativeAttention.get(20, kernel_dir) is None  # head_dim 20: not a multiple of 8


def test_a_local_header_is_part_of_the_builds_key(tmp_path):
    """A source's `#include "x.h"` beside it counts in its build's name: a changed header builds anew, not the cached
    object of the old one."""
    src = tmp_path / "k.c"
    src.write_text('#include <math.h>\n#include "k_part.h"\nint f(void) { return PART; }\n')
    (tmp_path / "k_part.h").write_text("#define PART 1\n")
    assert cpu_build.local_headers(src) == ["k_part.h"]
    cc = cpu_build.compiler()
    before = cpu_build.library_path(tmp_path, src, (), cc)
    (tmp_path / "k_part.h").write_text("#define PART 2\n")
    assert cpu_build.library_path(tmp_path, src, (), cc) != before
    assert "cpu_attention_dot.h" in cpu_build.local_headers(NativeAttention.SOURCE)


def test_without_a_compiler_attention_keeps_the_torch_path_and_the_log_says_why(kernel_dir, monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    monkeypatch.setattr(NativeAttention, "_all", {})
    with caplog.at_level(logging.WARNING, logger="engine"):
        k = NativeAttention.get(64, kernel_dir, wait=True)
    assert k.lib is None and "no C compiler" in k.error
    assert "native kernel unavailable, attention takes the torch path: no C compiler" in caplog.text
    attn = TorchAttention(16, 0.125)
    attn.native = k
    layout = StepLayout(torch.zeros(0, dtype=torch.long), [0, 1], [5], [[0]])
    assert attn.build(layout, torch.device("cpu")).native is None


def test_a_failed_compile_names_the_compilers_message(kernel_dir, monkeypatch):
    monkeypatch.setattr(cpu_build, "FLAGS", (*cpu_build.FLAGS, "-include", "/nonexistent.h"))
    with pytest.raises(RuntimeError, match="nonexistent.h"):
        cpu_build.build(kernel_dir, NativeAttention.SOURCE, ("-DHEAD_DIM=32",))


def test_sinks(kernel_dir):
    """GPT-OSS's sinks (a logit per query head in each softmax's denominator, no value), with and without a window;
    large ones change the output, so a kernel that ignored them would fail."""
    args = make_batch(MIXED, h=4, kvh=2, seed=11)
    check(args, kernel_dir, sinks=torch.randn(4) * 2)
    check(args, kernel_dir, window=4, sinks=torch.randn(4))
    a = cpu(args)
    plain = paged_attention_cpu(**a, kernel=kernel(a["q"].shape[-1], kernel_dir))
    sunk = paged_attention_cpu(**a, sinks=torch.full((4,), 6.0), kernel=kernel(a["q"].shape[-1], kernel_dir))
    assert (plain - sunk).abs().max() > 0.1
