"""Paged attention for a varlen batch mixing prefill chunks and decodes: Triton kernels, launcher, torch reference.

Layout (engine/layers/attention.py): caches [KVH, num_blocks, block_size, D]; q [T, H, D] is the flat batch;
sequence b owns rows query_start_loc[b]:query_start_loc[b+1] (n tokens), seq_lens[b] = L is its context
length INCLUDING those tokens, so its query j sits at position L-n+j and attends to positions <= L-n+j
(bottom-right causal). Head h reads kv head h // (H // KVH) (MHA, GQA, MQA). fp8 (e4m3) caches are
dequantized on load as x.float() * k_scale / v_scale. Per call (a layer's): `window` W, a query sees positions
> its own - W (Mistral, Gemma's local layers); `softcap` c, scores become c * tanh(s / c) (Gemma 2); `sinks` [H]
(GPT-OSS), a per-head logit that joins each row's softmax denominator with no value. Rows of q past
query_start_loc[-1] (padding) are left unspecified. Design: docs/kernels.md, "Paged attention".
"""

from __future__ import annotations

import torch

from kernels._common import cdiv, gpu_facts, jit, native_dot_for, next_power_of_2, scale_tensor, tl, use_triton
from kernels._library import ATTENTION_ARGS, attention_fake, triton_op

_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 32


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


# batch-varying ints stay runtime args: no compiled variant per value class (==1, %16==0, other) or split count
@jit(do_not_specialize=["num_seqs", "num_tokens", "stride_bt", "num_splits"])
def _paged_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    num_seqs,
    num_tokens,
    num_heads,
    head_dim,
    block_size,
    stride_qt,
    stride_qh,
    stride_kh,
    stride_kb,
    stride_ks,
    stride_ot,
    stride_oh,
    stride_bt,
    num_splits,
    window,
    softcap,
    sinks_ptr,
    REP: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    seq = _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - q_start  # this sequence's query tokens
    local = tile - (q_start + seq * (BLOCK_Q - 1)) // BLOCK_Q  # tile index inside the sequence
    if local * BLOCK_Q >= n:
        return
    ctx = tl.load(seq_lens_ptr + seq)  # context length including the n new tokens
    first_pos = ctx - n  # position of query 0

    rows = tl.arange(0, BLOCK_M)
    q_local = local * BLOCK_Q + rows // REP  # [BLOCK_M] query token inside the sequence
    head = kvh * REP + rows % REP  # [BLOCK_M] query head
    row_ok = (rows < BLOCK_Q * REP) & (q_local < n)
    q_pos = first_pos + q_local  # [BLOCK_M] absolute position of each row's query
    tok = (q_start + q_local).to(tl.int64)  # [BLOCK_M] flat row in q / out
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim

    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    k_scale = tl.load(k_scale_ptr)
    v_scale = tl.load(v_scale_ptr)

    # KV range of this tile: from its first query's window start to its last query (inclusive); this split's share
    kv_end = first_pos + tl.minimum(n, (local + 1) * BLOCK_Q)
    kv_lo = tl.maximum(first_pos + local * BLOCK_Q - window + 1, 0)  # window: 2**30 when the layer has none
    chunk = tl.cdiv(kv_end - kv_lo, num_splits)
    lo = kv_lo + split * chunk
    hi = tl.minimum(lo + chunk, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the sink is a position with weight e^sink and no value; split 0 alone counts it, once per row
        m_i = tl.load(sinks_ptr + head, mask=row_ok & (split == 0), other=float("-inf")).to(tl.float32)
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_kh  # K and V caches share their layout
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        pos_ok = pos < hi
        blk = tl.load(bt_row + pos // block_size, mask=pos_ok, other=0)
        blk = tl.where(pos_ok, blk, 0).to(tl.int64)
        in_blk = pos % block_size
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_base + blk[:, None] * stride_kb + in_blk[:, None] * stride_ks + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        v = tl.load(
            v_base + blk[:, None] * stride_kb + in_blk[:, None] * stride_ks + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        k = k.to(tl.float32) * k_scale
        v = v.to(tl.float32) * v_scale
        if NATIVE_DOT:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = s * scale  # [BLOCK_M, BLOCK_N] fp32
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        visible = row_ok[:, None] & pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked row: exp(-inf - 0) = 0, no NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if NATIVE_DOT:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        else:
            pv = tl.dot(p, v, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if not IS_SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        idx = (split * num_tokens + tok) * num_heads + head  # [BLOCK_M] into scratch [S, T, H]
        tl.store(m_ptr + idx, m_i, mask=row_ok)
        tl.store(l_ptr + idx, l_i, mask=row_ok)
        tl.store(acc_ptr + idx[:, None] * head_dim + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@jit(do_not_specialize=["num_tokens", "num_splits"])
def _reduce_splits_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    num_tokens,
    num_heads,
    head_dim,
    stride_ot,
    stride_oh,
    stride_od,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (token, head): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    idx = (s * num_tokens + tok) * num_heads + head  # [BLOCK_S]
    m = tl.load(m_ptr + idx, mask=s_ok, other=float("-inf"))
    l_s = tl.load(l_ptr + idx, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)  # empty splits (m = -inf) weigh 0
    acc = tl.load(
        acc_ptr + idx[:, None] * head_dim + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
    )  # [BLOCK_S, BLOCK_D]
    num = tl.sum(w[:, None] * acc, 0)
    den = tl.sum(w * l_s, 0)
    out = num / tl.where(den == 0.0, 1.0, den)
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + offs_d * stride_od, out.to(out_ptr.dtype.element_ty), mask=d_ok
    )


def _auto_num_splits(q: torch.Tensor, programs: int, max_ctx: int) -> int:
    """Flash-decoding split count: enough programs for ~2 per SM, <= one split per 256 context tokens."""
    facts = gpu_facts(q)
    if facts is None:
        return 1
    sms = facts.sms
    if programs >= sms:
        return 1
    return max(1, min(cdiv(2 * sms, programs), max_ctx // _MIN_SPLIT_TOKENS, _MAX_SPLITS))


def paged_attention_triton(
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
    block_n: int = 32,
) -> torch.Tensor:
    """Launcher. `max_query_len` is a hint (1: pure decode, one token per tile); any value stays correct.
    `native_dot` None: native_dot_for(q) (16-bit tl.dot operands on a GPU, fp32 in the interpreter)."""
    t, h, d = q.shape
    kvh, _, bs, dk = k_cache.shape
    assert dk == d and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    assert h % kvh == 0, f"{h} query heads not a multiple of {kvh} kv heads"
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), q.dtype
    b = seq_lens.shape[0]
    assert query_start_loc.shape[0] == b + 1 and block_tables.shape[0] == b
    assert block_tables.stride(-1) == 1 and seq_lens.is_contiguous() and query_start_loc.is_contiguous()
    assert sinks is None or (sinks.shape == (h,) and sinks.is_contiguous()), (h, sinks.shape)
    out = torch.empty_like(q)
    if t == 0 or b == 0:
        return out
    rep = h // kvh
    block_m = max(16, next_power_of_2(rep))
    block_q = 1 if max_query_len == 1 else block_m // rep  # two variants only: pure decode, or full tiles
    num_tiles = (t + b * (block_q - 1)) // block_q
    if num_splits is None:
        num_splits = _auto_num_splits(q, num_tiles * kvh, block_tables.shape[1] * bs)
    num_splits = int(num_splits)
    assert 1 <= num_splits <= _MAX_SPLITS, num_splits
    if native_dot is None:
        native_dot = native_dot_for(q)
    m_buf = l_buf = acc_buf = out  # scratch, unused when IS_SPLIT is False
    if num_splits > 1:
        # separate tensors: a view at num_splits * t * h floats into one buffer is 16-byte aligned only when that
        # product is a multiple of 4, and Triton compiles another variant for an unaligned pointer
        m_buf = torch.empty((num_splits, t, h), dtype=torch.float32, device=q.device)
        l_buf = torch.empty((num_splits, t, h), dtype=torch.float32, device=q.device)
        acc_buf = torch.empty((num_splits, t, h, d), dtype=torch.float32, device=q.device)
    block_d = max(16, next_power_of_2(d))
    _paged_attn_kernel[(num_tiles, kvh, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        m_buf,
        l_buf,
        acc_buf,
        block_tables,
        seq_lens,
        query_start_loc,
        scale_tensor(k_scale, q.device),
        scale_tensor(v_scale, q.device),
        float(scale),
        b,
        t,
        h,
        d,
        bs,
        *q.stride()[:2],
        *k_cache.stride()[:3],
        *out.stride()[:2],
        block_tables.stride(0),
        num_splits,
        window or 2**30,  # no window: one longer than any context
        float(softcap or 0.0),
        scale_tensor(None, q.device) if sinks is None else sinks,  # a dummy pointer when there are none
        REP=rep,
        IS_SPLIT=num_splits > 1,
        HAS_SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None,
        NATIVE_DOT=bool(native_dot),
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(t, h)](
            m_buf,
            l_buf,
            acc_buf,
            out,
            t,
            h,
            d,
            *out.stride(),
            num_splits,
            BLOCK_S=_MAX_SPLITS,
            BLOCK_D=block_d,
        )
    return out


def paged_attention_ref(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale=None, v_scale=None,
    max_query_len=None, num_splits=None, window=None, softcap=None, sinks=None,
) -> torch.Tensor:  # fmt: skip
    """Plain torch, one sequence at a time: gather its blocks, dequantize, causal softmax in fp32; a query sees the
    `window` latest positions (itself included) when set, and scores are soft-capped (softcap * tanh(s / softcap)).
    `sinks` [H] join the softmax as one more column per head (after the cap), dropped before the values (HF's way).
    max_query_len and num_splits are accepted for signature parity and ignored."""
    t, h, d = q.shape
    kvh, _, bs, _ = k_cache.shape
    rep = h // kvh
    out = torch.zeros_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    ks = 1.0 if k_scale is None else torch.as_tensor(k_scale, dtype=torch.float32, device=q.device)
    vs = 1.0 if v_scale is None else torch.as_tensor(v_scale, dtype=torch.float32, device=q.device)
    for i, ctx in enumerate(lens):
        s, e = qsl[i], qsl[i + 1]
        n = e - s
        if n == 0:
            continue
        blocks = block_tables[i, : cdiv(ctx, bs)].long()
        k = k_cache[:, blocks].reshape(kvh, -1, d)[:, :ctx].float() * ks  # [KVH, ctx, D]
        v = v_cache[:, blocks].reshape(kvh, -1, d)[:, :ctx].float() * vs
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # [H, ctx, D]
        qi = q[s:e].float().transpose(0, 1)  # [H, n, D]
        scores = qi @ k.transpose(1, 2) * scale  # [H, n, ctx]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        visible = (k_pos <= q_pos[:, None]) & (k_pos > q_pos[:, None] - (window or ctx + 1))  # [n, ctx]
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float().view(h, 1, 1).expand(h, n, 1)], -1)
        probs = scores.softmax(-1)[..., :ctx]
        out[s:e] = (probs @ v).transpose(0, 1).to(q.dtype)  # [n, H, D]
    return out


_paged_attention_op = triton_op("paged_attention" + ATTENTION_ARGS, attention_fake)(paged_attention_triton)


def paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale=None, v_scale=None,
    max_query_len=None, num_splits=None, window=None, softcap=None, sinks=None,
) -> torch.Tensor:  # fmt: skip
    """out [T, H, D] for q [T, H, D] over paged caches [KVH, num_blocks, block_size, D] (see module doc); the
    arguments are paged_attention_ref's. The Triton kernel for CUDA tensors (or when forced), else the reference."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    if not use_triton(q):
        return paged_attention_ref(*args, k_scale, v_scale, max_query_len, num_splits, window, softcap, sinks)
    k_scale, v_scale = (None if s is None else scale_tensor(s, q.device) for s in (k_scale, v_scale))
    return _paged_attention_op(*args, k_scale, v_scale, max_query_len, num_splits, window, softcap, sinks)
