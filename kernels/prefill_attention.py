"""Prefill attention: a varlen flash-attention kernel over the paged KV cache, its launcher, tile picker and torch
reference.

The operands and semantics are paged_attention's (kernels/paged_attention.py, module doc): q [T, H, D] is the flat
batch, caches are [KVH, num_blocks, block_size, D], sequence b's n queries are the last n of its seq_lens[b] positions
(bottom-right causal), head h reads kv head h // (H // KVH), fp8 caches carry per-tensor scales, and a call may set a
sliding `window`, a logit `softcap` and per-head `sinks` (GPT-OSS). What differs is the tile: a program owns BLOCK_M =
64-128 rows (BLOCK_Q query tokens times the REP query heads of one kv head, vLLM's unified-attention layout), so a K/V
tile is read once per BLOCK_Q queries instead of once per 4, and tl.dot runs at a size the tensor cores are built for.
Tile sizes per head size and GPU: `pick_tiles`. Design: docs/kernels.md, "Prefill attention".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels._common import gpu_facts, jit, native_dot_for, next_power_of_2, round_to, scale_tensor, tl, use_triton
from kernels._library import ATTENTION_ARGS, attention_fake, triton_op


@dataclass(frozen=True)
class Tiles:
    block_m: int  # query rows per program (tokens x GQA heads)
    block_n: int  # KV positions per loop step
    num_stages: int  # software-pipelining depth of the K/V loads
    num_warps: int


# Largest dynamic shared memory a block may opt into, per compute capability (CUDA programming guide, "Technical
# Specifications"). Not listed: 99 KiB, the consumer parts' figure (sm86 A10/A40/RTX 30xx, sm89 L4/L40S/RTX 40xx,
# sm120 RTX 50xx), which is also the safe guess for a part this table does not know.
SMEM_LIMIT = {(7, 0): 96 * 1024, (7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 7): 163 * 1024}
SMEM_LIMIT |= {(9, 0): 227 * 1024, (10, 0): 227 * 1024, (10, 3): 227 * 1024}
SMALL_SMEM = 99 * 1024
_SCRATCH = 2048  # Triton's own: the row max / row sum reductions' staging, layout conversions


def smem_limit(capability: tuple[int, int] | None) -> int:
    return SMEM_LIMIT.get(tuple(capability), SMALL_SMEM) if capability else SMALL_SMEM


def smem_bytes(tiles: Tiles, head_dim: int, elem: int = 2) -> int:
    """Shared memory one program needs, counted high: the Q tile, K and V tiles for every pipeline stage, P as the
    second dot's operand, Triton's scratch. elem: bytes per element of q (an fp8 cache's tiles are half that)."""
    d = max(16, next_power_of_2(head_dim))
    q = tiles.block_m * d * elem
    kv = 2 * tiles.num_stages * tiles.block_n * d * elem
    p = tiles.block_m * tiles.block_n * elem
    return q + kv + p + _SCRATCH


def pick_tiles(head_dim: int, capability: tuple[int, int] | None, elem: int = 2) -> Tiles:
    """Tile sizes for a head size on a GPU (capability None: the CPU interpreter). 64-128 rows everywhere they fit;
    head 256 takes 64 rows before Hopper (registers), and on the 99 KiB parts an unpipelined loop (64 + 32 + 4 + 2
    KiB = 70 KiB with 16-bit q). Whatever is picked is then shrunk (stages, then BLOCK_N, then BLOCK_M) until it
    fits the limit."""
    if capability is None:
        return Tiles(64, 32, 1, 4)  # the interpreter: bigger tiles are fewer numpy calls
    big = smem_limit(capability) >= 160 * 1024  # A100 / H100 / H200 / B200
    if head_dim <= 64:  # at 4 warps: 255 registers, spills on sm80-sm120, inside the KV loop on sm120 (compile_arch)
        tiles = Tiles(128, 64, 3 if big else 2, 8)
    elif head_dim <= 128:
        tiles = Tiles(128, 64, 3, 8) if big else Tiles(128, 32, 2, 8)
    elif big and capability[0] >= 9:  # 256 on sm90 / sm100: 128 rows compile to 249 registers, no spill
        tiles = Tiles(128, 32, 2, 8)
    else:  # 256 before Hopper: at 128 rows sm80 spills (255 registers, 240 B of spill stores, ptxas --verbose)
        tiles = Tiles(64, 32, 2 if big else 1, 8)
    limit = smem_limit(capability)
    while smem_bytes(tiles, head_dim, elem) > limit:
        if tiles.num_stages > 1:
            tiles = replace(tiles, num_stages=tiles.num_stages - 1)
        elif tiles.block_n > 16:
            tiles = replace(tiles, block_n=tiles.block_n // 2)
        elif tiles.block_m > 16:
            tiles = replace(tiles, block_m=tiles.block_m // 2)
        else:
            break  # 16 x 16 is tl.dot's floor
    return tiles


@jit
def _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence b whose first tile (qsl[b] + b*(BLOCK_Q-1)) // BLOCK_Q is <= tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = (tl.load(qsl_ptr + mid) + mid * (BLOCK_Q - 1)) // BLOCK_Q
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@jit
def _attend(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    start,
    kv_end,
    bt_row,
    k_base,
    v_base,
    block_size,
    stride_kb,
    stride_ks,
    offs_d,
    d_ok,
    qk_scale,
    softcap,
    window,
    MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One online-softmax step over KV positions [start, start + BLOCK_N). MASKED False: every position is < kv_end
    and visible to every row of the tile (no bounds, causal or window test)."""
    pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if MASKED:
        pos_ok = pos < kv_end
        blk = tl.load(bt_row + pos // block_size, mask=pos_ok, other=0)
        blk = tl.where(pos_ok, blk, 0).to(tl.int64)
        kv_mask = pos_ok[:, None] & d_ok[None, :]
    else:
        blk = tl.load(bt_row + pos // block_size).to(tl.int64)
        kv_mask = (pos >= 0)[:, None] & d_ok[None, :]  # all rows; d_ok folds away when BLOCK_D == head_dim
    off = blk[:, None] * stride_kb + (pos % block_size)[:, None] * stride_ks + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    k = tl.load(k_base + off, mask=kv_mask, other=0.0)
    v = tl.load(v_base + off, mask=kv_mask, other=0.0)
    if NATIVE_DOT:  # 16-bit operands, fp32 accumulation (an fp8 cache converts exactly to bf16 / fp16)
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    s = s * qk_scale  # [BLOCK_M, BLOCK_N] fp32, base 2 unless capped
    if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1; then base 2
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * 1.4426950408889634  # log2(e)
    if MASKED:
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: exp2(-inf) = 0, no NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if NATIVE_DOT:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    else:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return acc * alpha[:, None] + pv, m_new, l_i


# batch-varying ints stay runtime args: one compiled variant per model and tile shape, whatever the batch
@jit(do_not_specialize=["num_seqs", "num_tiles", "stride_bt"])
def _prefill_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    num_seqs,
    num_tiles,
    block_size,
    stride_qt,
    stride_qh,
    stride_kh,
    stride_kb,
    stride_ks,
    stride_ot,
    stride_oh,
    stride_bt,
    window,
    softcap,
    sinks_ptr,
    REP: tl.constexpr,
    HEAD_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # the last tiles first: a sequence's later tiles have the longest causal range, the GPU's tail gets short ones
    tile = num_tiles - 1 - tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    seq = _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - q_start  # this sequence's query tokens
    local = tile - (q_start + seq * (BLOCK_Q - 1)) // BLOCK_Q  # tile index inside the sequence
    if local * BLOCK_Q >= n:
        return
    first_pos = tl.load(seq_lens_ptr + seq) - n  # position of query 0

    rows = tl.arange(0, BLOCK_M)
    q_local = local * BLOCK_Q + rows // REP  # [BLOCK_M] query token inside the sequence
    head = kvh * REP + rows % REP  # [BLOCK_M] query head
    row_ok = (rows < BLOCK_Q * REP) & (q_local < n)
    q_pos = first_pos + q_local  # [BLOCK_M] absolute position of each row's query
    tok = (q_start + q_local).to(tl.int64)  # [BLOCK_M] flat row in q / out
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    k_scale = tl.load(k_scale_ptr)  # the fp8 scales fold into the scores and the output: K, V enter tl.dot as stored
    v_scale = tl.load(v_scale_ptr)
    if HAS_SOFTCAP:
        qk_scale = scale * k_scale
    else:
        # log2(e): scores are kept in base 2 (exp2 is one instruction, exp is exp2 plus a multiply)
        qk_scale = scale * k_scale * 1.4426950408889634

    # The tile's queries sit at [lo_q, hi_q]; together they see [kv_lo, kv_end). Positions in (hi_q - window, lo_q]
    # are visible to every row: that middle run of whole BLOCK_N steps skips the masks, the edges keep them.
    lo_q = first_pos + local * BLOCK_Q
    hi_q = first_pos + tl.minimum(n, (local + 1) * BLOCK_Q) - 1
    kv_lo = tl.maximum(lo_q - window + 1, 0)  # window: 2**30 when the layer has none
    kv_end = hi_q + 1
    mid_lo = kv_lo + tl.cdiv(tl.maximum(hi_q - window + 1, kv_lo) - kv_lo, BLOCK_N) * BLOCK_N
    mid_hi = mid_lo + tl.maximum(lo_q + 1 - mid_lo, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the sink is a position with weight e^sink and no value; base 2 like the scores
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_kh  # K and V caches share their layout
    for start in range(kv_lo, mid_lo, BLOCK_N):  # the window's edge (empty without a window)
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_pos, start, kv_end, bt_row, k_base, v_base, block_size, stride_kb, stride_ks,
            offs_d, d_ok, qk_scale, softcap, window, True, HAS_SOFTCAP, NATIVE_DOT, BLOCK_N,
        )  # fmt: skip
    for start in range(mid_lo, mid_hi, BLOCK_N):  # fully visible: the bulk of a long prompt's work
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_pos, start, kv_end, bt_row, k_base, v_base, block_size, stride_kb, stride_ks,
            offs_d, d_ok, qk_scale, softcap, window, False, HAS_SOFTCAP, NATIVE_DOT, BLOCK_N,
        )  # fmt: skip
    for start in range(mid_hi, kv_end, BLOCK_N):  # the causal diagonal
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_pos, start, kv_end, bt_row, k_base, v_base, block_size, stride_kb, stride_ks,
            offs_d, d_ok, qk_scale, softcap, window, True, HAS_SOFTCAP, NATIVE_DOT, BLOCK_N,
        )  # fmt: skip

    dt = out_ptr.dtype.element_ty
    out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        round_to(out, dt).to(dt),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def prefill_attention_triton(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    k_scale=None,
    v_scale=None,
    max_query_len=None,
    num_splits=None,
    window=None,
    softcap=None,
    sinks=None,
    *,
    native_dot: bool | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Launcher; paged_attention_triton's arguments (max_query_len and num_splits accepted and unused: one program
    covers a tile's whole KV range). `native_dot` None: native_dot_for(q) (16-bit tl.dot operands on a
    GPU, fp32 in the interpreter, whose bf16 tl.dot is wrong). `tiles` None: pick_tiles for this GPU (gpu_facts)."""
    t, h, d = q.shape
    kvh, _, bs, dk = k_cache.shape
    assert dk == d and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    assert h % kvh == 0, f"{h} query heads not a multiple of {kvh} kv heads"
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), q.dtype
    b = seq_lens.shape[0]
    assert query_start_loc.shape[0] == b + 1 and block_tables.shape[0] == b
    assert block_tables.stride(-1) == 1 and seq_lens.is_contiguous() and query_start_loc.is_contiguous()
    assert window is None or window >= 1, window
    assert sinks is None or (sinks.shape == (h,) and sinks.is_contiguous()), (h, sinks.shape)
    out = torch.empty_like(q)
    if t == 0 or b == 0:
        return out
    if tiles is None:
        facts = gpu_facts(q)
        tiles = pick_tiles(d, facts.capability if facts else None, q.element_size())
    assert tiles.block_m >= 16 and tiles.block_n >= 16, tiles  # tl.dot's smallest tile
    rep = h // kvh
    block_m = max(tiles.block_m, next_power_of_2(rep))
    block_q = block_m // rep  # rows past block_q * rep (REP not a power of two) are padding
    num_tiles = (t + b * (block_q - 1)) // block_q  # room for ceil(n_b / block_q) tiles per sequence, no host sync
    if native_dot is None:
        native_dot = native_dot_for(q)
    _prefill_attn_kernel[(num_tiles, kvh)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        scale_tensor(k_scale, q.device), scale_tensor(v_scale, q.device), float(scale), b, num_tiles, bs,
        *q.stride()[:2], *k_cache.stride()[:3], *out.stride()[:2], block_tables.stride(0),
        window or 2**30,  # no window: one longer than any context
        float(softcap or 0.0),
        scale_tensor(None, q.device) if sinks is None else sinks,  # a dummy pointer when there are none
        REP=rep, HEAD_D=d, HAS_SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None, NATIVE_DOT=bool(native_dot),
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_D=max(16, next_power_of_2(d)),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


def prefill_attention_ref(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    k_scale=None,
    v_scale=None,
    max_query_len=None,
    num_splits=None,
    window=None,
    softcap=None,
    sinks=None,
) -> torch.Tensor:
    """Plain torch, one sequence at a time: each context position's cache slot through the block table, dequantize,
    scores per kv head for its group of query heads (no repeated K/V), fp32 softmax over the visible positions
    (causal, within `window` when set, soft-capped when set); `sinks` [H] join it as one more column per head,
    dropped before the values. max_query_len, num_splits: accepted, ignored."""
    t, h, d = q.shape
    kvh, _, bs, _ = k_cache.shape
    rep = h // kvh
    out = torch.zeros_like(q)
    ks = 1.0 if k_scale is None else torch.as_tensor(k_scale, dtype=torch.float32, device=q.device)
    vs = 1.0 if v_scale is None else torch.as_tensor(v_scale, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for i, ctx in enumerate(seq_lens.tolist()):
        n = qsl[i + 1] - qsl[i]
        if n == 0:
            continue
        pos = torch.arange(ctx, device=q.device)
        slots = block_tables[i].long()[pos // bs] * bs + pos % bs  # [ctx]
        k = k_cache.reshape(kvh, -1, d)[:, slots].float() * ks  # [KVH, ctx, D]
        v = v_cache.reshape(kvh, -1, d)[:, slots].float() * vs
        qi = q[qsl[i] : qsl[i + 1]].float().view(n, kvh, rep, d)
        scores = torch.einsum("nkrd,kcd->krnc", qi, k) * scale  # [KVH, REP, n, ctx]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        visible = pos[None, :] <= q_pos  # [n, ctx]
        if window:
            visible &= pos[None, :] > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float().view(kvh, rep, 1, 1).expand(kvh, rep, n, 1)], -1)
        probs = scores.softmax(-1)[..., :ctx]
        out[qsl[i] : qsl[i + 1]] = torch.einsum("krnc,kcd->nkrd", probs, v).reshape(n, h, d).to(q.dtype)
    return out


_prefill_attention_op = triton_op("prefill_attention" + ATTENTION_ARGS, attention_fake)(prefill_attention_triton)


def prefill_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale=None, v_scale=None,
    max_query_len=None, num_splits=None, window=None, softcap=None, sinks=None,
) -> torch.Tensor:  # fmt: skip
    """out [T, H, D] for q [T, H, D] over paged caches [KVH, num_blocks, block_size, D] (see module doc); the
    arguments are prefill_attention_ref's. The Triton kernel for CUDA tensors (or when forced), else the reference."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    if not use_triton(q):
        return prefill_attention_ref(*args, k_scale, v_scale, max_query_len, num_splits, window, softcap, sinks)
    k_scale, v_scale = (None if s is None else scale_tensor(s, q.device) for s in (k_scale, v_scale))
    return _prefill_attention_op(*args, k_scale, v_scale, max_query_len, num_splits, window, softcap, sinks)
