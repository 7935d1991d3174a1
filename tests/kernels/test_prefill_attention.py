"""Prefill attention (kernels/prefill_attention.py): the flash-tile Triton kernel (interpreter on CPU, or on DEVICE)
against its torch reference and paged_attention's, on tiny varlen batches whose unused KV slots are NaN; and the
tile picker's shared-memory estimate on every GPU it knows. Tiles of 16 rows x 16 positions here, so a few dozen
tokens already cross several query tiles, KV steps and cache blocks."""

import pytest
import torch

import kernels
from kernels.paged_attention import paged_attention_ref
from kernels.prefill_attention import (
    SMALL_SMEM,
    Tiles,
    pick_tiles,
    prefill_attention,
    prefill_attention_ref,
    prefill_attention_triton,
    smem_bytes,
    smem_limit,
)
from tests.kernels.conftest import ATTN_TOL, DEVICE, TOL, assert_close
from tests.kernels.test_paged_attention import FP8, FP8_TOL, make_batch

SMALL = Tiles(16, 16, 1, 4)
# (query tokens, context incl. them): odd full prompts, a chunk that starts mid-block over 9 cached positions, a
# decode riding along, a 40-token chunk over 30 cached positions (its later tiles run the mask-free middle loop)
PREFILL = [(13, 13), (21, 30), (1, 5), (40, 70), (7, 7)]


def check(args, tol=None, **kw):
    ref = prefill_attention_ref(**args, window=kw.get("window"), softcap=kw.get("softcap"))
    out = prefill_attention_triton(**args, **{"tiles": SMALL, **kw})
    assert out.dtype == args["q"].dtype and out.shape == args["q"].shape
    assert torch.isfinite(ref).all()
    assert torch.isfinite(out).all(), "NaN/inf leaked from unused KV slots"
    assert_close(out, ref, "prefill_attention", **(tol or ATTN_TOL[ref.dtype]))
    return out, ref


@pytest.mark.parametrize(
    "h,kvh,d", [(4, 2, 64), (4, 1, 128), (2, 2, 64), (6, 2, 32)], ids=["gqa", "mqa", "mha", "rep3"]
)
def test_varlen_batch(h, kvh, d):
    # rep3: REP = 3 (SmolLM2's 9 / 3), so a 16-row tile holds 5 tokens and one padding row
    check(make_batch(PREFILL, h=h, kvh=kvh, d=d, bs=4, seed=d + h))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision(dtype):
    check(make_batch(PREFILL, d=64, bs=8, dtype=dtype, seed=2))


@pytest.mark.parametrize("window,softcap", [(1, None), (5, None), (16, None), (None, 1.5), (19, 2.0)])
def test_window_and_softcap(window, softcap):
    # window 1: each query sees itself only; 5 and 16 cut inside chunks and across cached blocks, so the left-edge
    # loop runs, and a 16-row tile's rows start their windows at different KV steps (rows masked for a whole step)
    args = make_batch(PREFILL, d=64, bs=4, seed=3)
    args["q"] = args["q"] * 4  # scores large enough that the cap clips
    check(args, window=window, softcap=softcap)


def test_matches_paged_attention_reference():
    # two references written differently (block gather + repeated heads vs slot gather + grouped heads)
    args = make_batch(PREFILL, h=4, kvh=2, d=64, bs=4, seed=4)
    for window, softcap in [(None, None), (7, 2.0)]:
        ref = paged_attention_ref(**args, window=window, softcap=softcap)
        assert_close(prefill_attention_ref(**args, window=window, softcap=softcap), ref, "refs", **TOL[torch.float32])
        assert_close(prefill_attention(**args, window=window, softcap=softcap), ref, "kernel vs paged ref")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_kv(dtype):
    args = make_batch(PREFILL, d=64, bs=4, dtype=dtype, kv_dtype=FP8, seed=5)
    assert torch.isnan(args["k_cache"].float()).any()  # the poison survives the fp8 cast
    check(args, FP8_TOL)
    check(args, FP8_TOL, window=6)


def test_chunked_prefill_equals_whole_prompt():
    # A 45-token prompt run as one prefill, then as chunks of 16 + 16 + 13 over the blocks the earlier chunks
    # filled: each chunk's rows equal the whole prompt's rows.
    args = make_batch([(45, 45)], h=4, kvh=2, d=64, bs=4, seed=6)
    whole = prefill_attention_triton(**args, tiles=SMALL)
    for start, end in [(0, 16), (16, 32), (32, 45)]:
        part = {**args, "q": args["q"][start:end].contiguous()}
        part["seq_lens"] = torch.tensor([end], dtype=torch.int32, device=DEVICE)
        part["query_start_loc"] = torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE)
        assert_close(prefill_attention_triton(**part, tiles=SMALL), whole[start:end], f"chunk {start}:{end}")


def test_default_tiles_and_empty_sequences():
    # pick_tiles' interpreter tiles (64 x 32); a sequence with no queries this step, and the engine's warm-up shape
    # (context 0 under 4 query tokens: nothing read, finite output)
    args = make_batch([(13, 13), (0, 6), (1, 9), (17, 30)], d=32, bs=4, seed=7)
    check(args, tiles=None)
    warm = {**args, "seq_lens": torch.zeros(4, dtype=torch.int32, device=DEVICE)}
    warm["query_start_loc"] = torch.tensor([0, 4, 8, 12, 16], dtype=torch.int32, device=DEVICE)
    warm["q"] = args["q"][:16].contiguous()
    assert torch.isfinite(prefill_attention_triton(**warm, tiles=SMALL)[:16]).all()


def test_native_dot_path():
    # NATIVE_DOT=True feeds tl.dot the stored dtype; under the interpreter in fp32 it is the same math (its bf16
    # tl.dot is wrong), on a GPU it is checked in bf16 at bf16 tolerance
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    args = make_batch(PREFILL, d=64, bs=4, dtype=dtype, seed=8)
    out = prefill_attention_triton(**args, native_dot=True, tiles=SMALL)
    assert_close(out, prefill_attention_ref(**args), "nd", **ATTN_TOL[dtype])


def test_dispatch_and_check_can_fail():
    args = make_batch(PREFILL, d=32, bs=4, seed=9)
    ref = prefill_attention_ref(**args)
    kernels.set_backend("torch")
    assert_close(prefill_attention(**args), ref, "dispatch torch")
    kernels.set_backend("triton")
    with pytest.raises(AssertionError):  # wrong softmax scale
        assert_close(prefill_attention_triton(**{**args, "scale": args["scale"] * 1.1}, tiles=SMALL), ref, "scale")
    swapped = args["block_tables"].clone()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]  # the 13-token prompt: its causal mask tells blocks 0 and 1 apart
    with pytest.raises(AssertionError):
        assert_close(prefill_attention_triton(**{**args, "block_tables": swapped}, tiles=SMALL), ref, "swapped")
    with pytest.raises(AssertionError):  # a window the kernel ignored would show
        assert_close(prefill_attention_triton(**args, tiles=SMALL), prefill_attention_ref(**args, window=5), "win")


CAPS = {"sm80": (8, 0), "sm86": (8, 6), "sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}


@pytest.mark.parametrize("arch", CAPS)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_tiles_fit_shared_memory(arch, head_dim):
    cap = CAPS[arch]
    tiles = pick_tiles(head_dim, cap)
    assert smem_bytes(tiles, head_dim) <= smem_limit(cap), (arch, head_dim, tiles)
    assert tiles.block_m >= 64 and tiles.block_n >= 32, tiles  # a flash tile, not the decode kernel's 16 rows
    if cap in ((8, 6), (8, 9), (12, 0)):
        assert smem_limit(cap) == SMALL_SMEM == 99 * 1024
    if head_dim == 256 and smem_limit(cap) == SMALL_SMEM:
        # 64 x 256 Q (32 KiB) + one stage of 32-row K and V (32 KiB) + P (4 KiB) + scratch
        assert tiles == Tiles(64, 32, 1, 8) and smem_bytes(tiles, 256) == 70 * 1024


def test_tile_picker_shrinks_to_fit():
    # fp32 q doubles every tile; an unknown part gets the 99 KiB guess; a 64 KiB part (sm75) still gets a tile
    for cap in [(8, 6), (7, 5), (11, 0), None]:
        for head_dim in (64, 128, 256):
            tiles = pick_tiles(head_dim, cap, elem=4)
            assert cap is None or smem_bytes(tiles, head_dim, 4) <= smem_limit(cap), (cap, head_dim, tiles)
    assert smem_bytes(Tiles(64, 32, 2, 8), 256) > SMALL_SMEM  # the pipelined head-256 tile that does not fit
