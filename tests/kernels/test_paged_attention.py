"""Paged attention (kernels/paged_attention.py): the Triton kernel (interpreter on CPU, or on DEVICE) against the
torch reference and against the engine's TorchAttention backend, on tiny mixed batches whose unused KV slots are
NaN. Batches are drawn on CPU, then moved to DEVICE."""

import inspect
import itertools
import sys

import pytest
import torch

from engine.layers.attention import StepLayout, TorchAttention
from kernels.paged_attention import paged_attention, paged_attention_ref, paged_attention_triton
from tests.kernels.conftest import ATTN_TOL, DEVICE, TOL, assert_close, to_device

FP8 = torch.float8_e4m3fn
FP8_TOL = dict(atol=1e-2, rtol=1.6e-2)  # vLLM's fp8 KV atol

# (query tokens, context length incl. them): a decode whose context is not a multiple of the block size, a
# chunk starting mid-block with context before it, a full prefill from position 0, a 1-token sequence,
# a longer decode.
MIXED = [(1, 7), (5, 14), (9, 9), (1, 1), (1, 23)]


def make_batch(spec, h=4, kvh=2, d=32, bs=4, dtype=torch.float32, kv_dtype=None, poison=True, seed=0):
    """Random q and caches for `spec`; blocks come from a shuffled pool, unused slots and blocks are NaN,
    padded block-table entries point far outside the pool (they must never be read). Drawn on CPU; every
    tensor of the result is on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    nblk = [-(-ctx // bs) for _, ctx in spec]
    num_blocks = sum(nblk) + 3  # a few blocks nobody owns
    fill = float("nan") if poison else 0.0
    k = torch.full((kvh, num_blocks, bs, d), fill)  # [KVH, NB, BS, D] fp32 master copy
    v = torch.full((kvh, num_blocks, bs, d), fill)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(spec), max(nblk) + 2), 10**6, dtype=torch.int32)  # padding: out of range
    for i, (_, ctx) in enumerate(spec):
        for j in range(nblk[i]):
            blk = perm.pop()
            tables[i, j] = blk
            m = min(bs, ctx - j * bs)
            k[:, blk, :m] = torch.randn(kvh, m, d, generator=g)
            v[:, blk, :m] = torch.randn(kvh, m, d, generator=g)
    k_scale = v_scale = None
    if kv_dtype == FP8:
        k_scale, v_scale = torch.tensor(0.05), torch.tensor(0.03)
        k, v = (k / k_scale).to(FP8), (v / v_scale).to(FP8)
    else:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    nq = [n for n, _ in spec]
    qsl = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(nq), h, d, generator=g).to(dtype)
    seq_lens = torch.tensor([ctx for _, ctx in spec], dtype=torch.int32)
    q, k, v, tables, seq_lens, qsl, k_scale, v_scale = to_device(q, k, v, tables, seq_lens, qsl, k_scale, v_scale)
    return dict(
        q=q,
        k_cache=k,
        v_cache=v,
        block_tables=tables,
        seq_lens=seq_lens,
        query_start_loc=qsl,
        scale=d**-0.5,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def check(args, tol=None, **kw):
    ref = paged_attention_ref(**args)
    out = paged_attention(**args, **kw)
    assert out.dtype == args["q"].dtype and out.shape == args["q"].shape
    assert torch.isfinite(ref).all()
    assert torch.isfinite(out).all(), "NaN/inf leaked from unused KV slots"
    assert_close(out, ref, "paged_attention", **(tol or ATTN_TOL[ref.dtype]))
    return out, ref


@pytest.mark.parametrize("h,kvh", [(4, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mixed_batch(h, kvh, dtype):
    check(make_batch(MIXED, h=h, kvh=kvh, dtype=dtype))


@pytest.mark.parametrize("d,bs", [(16, 8), (48, 4), (64, 8)])
def test_head_dims(d, bs):
    # 48 is not a power of two: BLOCK_D = 64 with a mask. fp32 scores of |q.k| ~ sqrt(d) keep within 1e-5.
    check(make_batch(MIXED, d=d, bs=bs, seed=d))


def test_gqa_non_power_of_two_group():
    # SmolLM2's 9 heads / 3 kv heads: REP = 3, so BLOCK_Q = 16 // 3 = 5 tokens per tile and padded rows.
    check(make_batch(MIXED, h=6, kvh=2, seed=3))
    check(make_batch(MIXED, h=6, kvh=2, seed=3), max_query_len=9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_kv(dtype):
    args = make_batch(MIXED, dtype=dtype, kv_dtype=FP8, seed=5)
    assert torch.isnan(args["k_cache"].float()).any()  # the poison survives the fp8 cast
    check(args, FP8_TOL)


def test_pure_decode_hint():
    # max_query_len=1: one token per tile, grid of exactly T tiles.
    args = make_batch([(1, 7), (1, 1), (1, 16), (1, 30)], seed=7)
    check(args, max_query_len=1)


def test_flash_decoding_splits():
    args = make_batch([(1, 40), (1, 3), (1, 17)], h=4, kvh=2, seed=11)
    ref = paged_attention_ref(**args)
    one = paged_attention_triton(**args, num_splits=1)
    three = paged_attention_triton(**args, num_splits=3)  # 40 tokens: 14+14+12; 3 tokens: 1+1+1
    five = paged_attention_triton(**args, num_splits=5)  # context 3 < 5 splits: empty splits
    for name, out in [("splits=1", one), ("splits=3", three), ("splits=5", five)]:
        assert torch.isfinite(out).all()
        assert_close(out, ref, name)
    assert_close(three, one, "splits 3 vs 1")


def test_splits_on_mixed_batch_bf16():
    # Splits also apply to prefill tiles; rows whose visible range misses a split get (-inf, 0, 0) there.
    check(make_batch(MIXED, dtype=torch.bfloat16, seed=13), num_splits=2)
    check(make_batch(MIXED, kv_dtype=FP8, seed=14), FP8_TOL, num_splits=4)


def test_empty_sequence_and_native_dot_path():
    # A sequence with no query tokens this step gets no tile. native_dot=True runs the 16-bit-operand
    # branch; under the interpreter, in fp32, it is the same math (the interpreter cannot check bf16 tl.dot,
    # triton#11584). On a GPU fp32 operands there would go through tf32, so the branch is checked where it
    # is meant to run: bf16 operands, against the reference at bf16 tolerance.
    spec = [(1, 9), (0, 5), (4, 6)]
    args = make_batch(spec, seed=17)
    check(args)
    if DEVICE.type == "cuda":
        args = make_batch(spec, dtype=torch.bfloat16, seed=17)
    out = paged_attention_triton(**args, native_dot=True)
    assert_close(out, paged_attention_ref(**args), "native_dot")


def test_reference_backend_dispatch():
    import kernels

    args = make_batch(MIXED, seed=19)
    kernels.set_backend("torch")
    assert_close(paged_attention(**args), paged_attention_ref(**args), "dispatch torch")


def test_check_can_fail():
    args = make_batch(MIXED, seed=23)
    ref = paged_attention_ref(**args)
    with pytest.raises(AssertionError):  # wrong softmax scale
        assert_close(paged_attention_triton(**{**args, "scale": args["scale"] * 1.1}), ref, "wrong scale")
    # Swapped blocks in the full prefill: keys are permutation-invariant for a query that sees both blocks
    # (swapping in the 14-token chunk, whose queries all see blocks 0-1, goes unnoticed), but the causal
    # mask of queries 0-7 is not.
    swapped = args["block_tables"].clone()
    swapped[2, [0, 1]] = swapped[2, [1, 0]]
    with pytest.raises(AssertionError):
        assert_close(paged_attention_triton(**{**args, "block_tables": swapped}), ref, "swapped blocks")
    fp8 = make_batch(MIXED, kv_dtype=FP8, seed=23)
    with pytest.raises(AssertionError):  # v_scale ignored
        assert_close(
            paged_attention_triton(**{**fp8, "v_scale": None}), paged_attention_ref(**fp8), "no v_scale", **FP8_TOL
        )


@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (None, 1.5), (6, 2.0)])
def test_matches_engine_torch_backend(window, softcap):
    """Same mixed batch through engine.layers.attention.TorchAttention (which also writes the cache: the new
    tokens' k/v are the values already at their slots), with a sliding window and a soft-cap as Gemma's layers
    set them. No NaN poison here: the engine's decode path multiplies masked probabilities by padded V rows, so
    it needs finite unused slots."""
    bs, h, kvh, d = 4, 4, 2, 32
    args = make_batch(MIXED + [(1, 19)], h=h, kvh=kvh, d=d, bs=bs, poison=False, seed=29)
    args["q"] = args["q"] * 4  # scores large enough that the cap clips
    qsl, lens, tables = args["query_start_loc"].tolist(), args["seq_lens"].tolist(), args["block_tables"]
    slots = []
    for i, ctx in enumerate(lens):
        for pos in range(ctx - (qsl[i + 1] - qsl[i]), ctx):
            slots.append(int(tables[i, pos // bs]) * bs + pos % bs)
    slot_mapping = torch.tensor(slots, device=DEVICE)  # [T] int64
    k_cache, v_cache = args["k_cache"].clone(), args["v_cache"].clone()
    k_new = k_cache.view(kvh, -1, d)[:, slot_mapping].transpose(0, 1).contiguous()  # [T, KVH, D]
    v_new = v_cache.view(kvh, -1, d)[:, slot_mapping].transpose(0, 1).contiguous()
    layout = StepLayout(
        slot_mapping=slot_mapping,
        query_start_loc=qsl,
        seq_lens=lens,
        block_tables=[tables[i, : -(-ctx // bs)].tolist() for i, ctx in enumerate(lens)],
    )
    attn = TorchAttention(bs, args["scale"])
    attn.windows, attn.softcap = (None, window), softcap  # layer 1 has the window
    expected = attn.forward(args["q"], k_new, v_new, k_cache, v_cache, attn.build(layout, DEVICE), layer=1)
    assert torch.equal(k_cache, args["k_cache"])  # the cache write was a no-op
    got = paged_attention(**args, window=window, softcap=softcap)
    assert_close(got, expected, "vs engine TorchAttention", **TOL[torch.float32])


def test_no_scale_tensor_is_built_per_call_for_a_16bit_cache(monkeypatch):
    """A 16-bit cache's 1.0 scales are made once per device: built per call they were a blocking host-to-device
    copy (a stream sync) twice per layer in every step on a GPU."""
    args = make_batch(MIXED)
    paged_attention_triton(**args)  # the first call may make them
    made = []
    real = torch.as_tensor
    monkeypatch.setattr(torch, "as_tensor", lambda *a, **k: made.append(a) or real(*a, **k))
    monkeypatch.setattr(torch, "ones", lambda *a, **k: pytest.fail("a scale tensor was built again"))
    out = paged_attention_triton(**args)
    assert not made and out.isfinite().all()


def test_batch_shapes_share_compiled_variants(monkeypatch):
    """What Triton compiles a variant for (constexprs, the value class of every int argument it specializes:
    == 1, % 16 == 0, other, and whether each tensor argument's address is 16-byte aligned) must not change with the
    batch. Across 1..40 sequences, decode and mixed batches, split counts 1..32, block-table widths and 4 or 9
    heads (9: SmolLM2's, where split scratch sized splits x tokens x heads floats can end off a 16-byte boundary),
    only {decode, full tiles} x {split, not} remain."""
    pa = sys.modules["kernels.paged_attention"]  # the package exports a function of the same name
    seen = set()
    for kernel in (pa._paged_attn_kernel, pa._reduce_splits_kernel):
        params = inspect.signature(getattr(kernel, "fn", kernel)).parameters  # JITFunction or the interpreter's
        names = list(params)
        dns = kernel.kwargs["do_not_specialize"] if hasattr(kernel, "kwargs") else kernel.do_not_specialize
        skip = {n if isinstance(n, str) else names[n] for n in dns}
        skip |= {n for n, p in params.items() if "constexpr" in str(p.annotation)}

        class Recorder:
            def __init__(self, kernel, names, skip):
                self.kernel, self.names, self.skip = kernel, names, skip

            def __getitem__(self, grid):
                def launch(*args, **constexprs):
                    ints = {n: a for n, a in zip(self.names, args) if type(a) is int and n not in self.skip}
                    key = tuple(sorted((n, a == 1, a % 16 == 0) for n, a in ints.items()))
                    ptrs = {n: a for n, a in zip(self.names, args) if isinstance(a, torch.Tensor)}
                    key += tuple(sorted((n, a.data_ptr() % 16 == 0) for n, a in ptrs.items()))
                    seen.add((self.kernel.__name__, key, tuple(sorted(constexprs.items()))))

                return launch

        monkeypatch.setattr(pa, kernel.__name__, Recorder(kernel, names, skip))
    for (heads, kv_heads), n_seqs in itertools.product(((4, 2), (9, 3)), (1, 2, 3, 16, 17, 40)):
        for decode in (True, False):
            spec = [(1 if decode else 3, 5 + i) for i in range(n_seqs)]
            args = make_batch(spec, h=heads, kvh=kv_heads, poison=False)
            for splits in (1, 2, 7, 16, 32):
                pa.paged_attention_triton(**args, max_query_len=1 if decode else 3, num_splits=splits)
                wide = dict(args, block_tables=torch.cat([args["block_tables"]] * 3, 1))  # another width
                pa.paged_attention_triton(**wide, max_query_len=1 if decode else 3, num_splits=splits)
    attn = {(k, c) for name, k, c in seen if name == "_paged_attn_kernel"}
    reduce = {(k, c) for name, k, c in seen if name == "_reduce_splits_kernel"}
    geometries = {dict(c)["REP"] for _, c in attn}  # query heads per KV head: fixed per model
    assert len(geometries) == 2 and len(attn) == 4 * 2, attn  # per model: BLOCK_Q in {1, full} x IS_SPLIT
    assert len(reduce) == 1, reduce


def _dense(args, window, softcap):
    """Attention computed the plainest way, per sequence from its contiguous K/V: the reference's reference."""
    q, kc, vc, bt = (
        args["q"].float().cpu(),
        args["k_cache"].float().cpu(),
        args["v_cache"].float().cpu(),
        args["block_tables"].cpu(),
    )
    lens, qsl = args["seq_lens"].tolist(), args["query_start_loc"].tolist()
    kvh, _, bs, d = kc.shape
    rep, out = q.shape[1] // kvh, torch.zeros_like(q)
    for i, ctx in enumerate(lens):
        blocks = bt[i, : -(-ctx // bs)].long()
        k = kc[:, blocks].reshape(kvh, -1, d)[:, :ctx].repeat_interleave(rep, 0)  # [H, ctx, D]
        v = vc[:, blocks].reshape(kvh, -1, d)[:, :ctx].repeat_interleave(rep, 0)
        for j in range(qsl[i], qsl[i + 1]):
            p = ctx - (qsl[i + 1] - j)  # this query's position
            s = (q[j][:, None, :] * k).sum(-1) * args["scale"]  # [H, ctx]
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            lo = max(0, p - window + 1) if window else 0
            s[:, :lo], s[:, p + 1 :] = float("-inf"), float("-inf")
            out[j] = (s.softmax(-1)[:, :, None] * v).sum(1)
    return out


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (3, 1.5), (1, None)])
def test_sliding_window_and_softcap(window, softcap, splits):
    """Gemma's and Mistral's attention: windows shorter than the contexts (a window of 1: each query sees
    itself), soft-caps that clip (q scaled up so |scores| >> softcap), with flash-decoding splits over the window."""
    args = make_batch(MIXED + [(1, 23), (6, 20)], h=4, kvh=2, seed=17)
    args["q"] = args["q"] * 4
    kw = dict(window=window, softcap=softcap)
    ref = paged_attention_ref(**args, **kw)
    assert_close(ref.cpu(), _dense(args, window, softcap), "reference vs dense")
    out = paged_attention_triton(**args, **kw, num_splits=splits)
    assert_close(out, ref, f"window={window} softcap={softcap} splits={splits}")
    plain = paged_attention_ref(**args)
    assert (ref - plain).abs().max() > 1e-2  # the window / cap changes the result: the test could fail
