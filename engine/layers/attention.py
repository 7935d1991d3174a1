"""Paged attention over the KV pool for a varlen batch that mixes prefill chunks and decodes.

The backend interface: `build(layout) -> metadata` once per step, then `forward(q, k, v, caches, meta)`
per layer. The torch reference here defines correctness and is the CPU fast path. Per layer:
- one cache write for all new tokens;
- on CPU with the C kernel (kernels/cpu_attention.py, built before the first step): one call for the whole step,
  prefill chunks and decodes alike, reading the pages where they lie. Without a compiler, or when its build fails:
- decodes (one query each): one gather of their pages and two batched matmuls per length bucket (at most 4
  buckets, so short contexts are not padded to the longest), never a per-sequence loop;
- prefill chunks: one SDPA call each over the chunk's own context (a chunk that is its whole context reads its
  new keys as they are, no gather). A step holds few of them (the token budget bounds it) and each call is large,
  while padding them into one call wasted up to 4x the work on mixed lengths."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.block_table import h2d, h2d_rows
from kernels.cache_write import reshape_and_cache
from kernels.cpu_attention import Q_DTYPES as NATIVE_WRITES
from kernels.cpu_attention import NativeAttention
from kernels.paged_attention import paged_attention
from kernels.prefill_attention import prefill_attention

# A step with a longer query chunk runs the flash-tile prefill kernel (64-128 rows a tile, decodes riding along);
# up to this, the unified kernel's 16-row tiles and flash-decoding splits fit better.
PREFILL_TILE_MIN_QUERY = 16
# Prefill chunks through the C kernel too (with it loaded), not SDPA: bench/ab.py's --ab native-prefill
NATIVE_PREFILL = True
# The C kernel writes the step's new K/V rows in its own call (else reshape_and_cache per layer): --ab native-write
NATIVE_WRITE = True
EXPLICIT_SCORES = 1 << 24  # scores a slice of the spelled-out attention holds at once (64 MiB in fp32)


@dataclass
class StepLayout:
    """The flat batch's shape, as the model runner lays it out."""

    slot_mapping: torch.Tensor  # [T] int64 cache slot for each new token
    query_start_loc: list[int]  # [B+1] token offsets of each sequence in the flat batch
    seq_lens: list[int]  # [B] context length after this step
    block_tables: list[list[int]]  # [B][blocks]
    block_table: torch.Tensor | None = None  # [B, >= blocks] int32 on the device (DeviceBlockTable), when kept


@dataclass
class _Decodes:
    rows: torch.Tensor  # [G] flat token row of each decode
    blocks: torch.Tensor  # [G * nblk] block ids, row-major, padded with block 0 (masked out)
    mask: torch.Tensor  # [1, G, 1, L] bool (L = nblk * block_size): position < seq_len
    ctx: torch.Tensor  # [G] seq_len
    windowed: dict = field(default_factory=dict)  # window -> mask, made by the first layer that has that window

    def mask_for(self, window: int | None) -> torch.Tensor:
        if not window:
            return self.mask
        if window not in self.windowed:  # also: position > seq_len - 1 - window
            pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.windowed[window] = self.mask & (pos > (self.ctx - 1 - window)[:, None])[None, :, None, :]
        return self.windowed[window]


@dataclass
class _Native:
    rows: torch.Tensor | None  # [G] flat token rows of the sequences it takes; None: every row of the step, in order
    tables: torch.Tensor  # [B, max blocks] int32, padded with block 0 (never read past ctx)
    ctx: torch.Tensor  # [B] int32 seq_len
    qsl: torch.Tensor  # [B + 1] int32: their query_start_loc within `rows`


@dataclass
class _Prefill:
    start: int  # first flat row of the chunk
    num_q: int  # chunk length
    ctx: int  # context length including the chunk
    blocks: torch.Tensor  # [ceil(ctx / block_size)] block ids
    mask: torch.Tensor | None  # [num_q, ctx] bool when the chunk has earlier context; None: plain causal


@dataclass
class TorchAttnMetadata:
    slot_mapping: torch.Tensor
    decodes: list[_Decodes]
    prefills: list[_Prefill]
    native: _Native | None = None  # what the C kernel takes: the whole step (`decodes`, `prefills` empty)


@dataclass
class TritonAttnMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (never read past seq_len)
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    max_query_len: int


FP8 = torch.float8_e4m3fn


class _KVScales:
    """Per-layer fp8 KV scales (fp32 [layers] tensors), set by the engine once it knows them; None for a
    16/32-bit cache. Per-layer sliding windows (None: full attention) and the logit soft-cap, set by the model."""

    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None
    windows: tuple[int | None, ...] = ()
    softcap: float | None = None

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if layer < len(self.windows) else None

    def set_kv_scales(self, k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
        self.k_scales, self.v_scales = k_scales, v_scales

    def _scales(self, layer: int):
        if self.k_scales is None:
            return None, None
        return self.k_scales[layer], self.v_scales[layer]


class TritonAttention(_KVScales):
    """The kernels path: one cache-write launch and one attention launch per layer, for prefill chunks and
    decodes alike: the unified paged-attention kernel (kernels/paged_attention.py), or the flash-tile prefill
    kernel (kernels/prefill_attention.py) when a chunk is longer than PREFILL_TILE_MIN_QUERY. Used on CUDA, and
    on CPU under the Triton interpreter when the config forces it (tests)."""

    def __init__(self, block_size: int, scale: float):
        self.block_size = block_size
        self.scale = scale

    def build(self, layout: StepLayout, device) -> TritonAttnMetadata:
        qsl, tables = layout.query_start_loc, layout.block_tables
        nblk = max(len(t) for t in tables)
        if layout.block_table is not None:  # only the used width: it sets the split count
            bt = layout.block_table[:, :nblk]
        else:
            bt = h2d([t + [0] * (nblk - len(t)) for t in tables], torch.int32, device)
        seq_lens, qsl_t = h2d_rows([layout.seq_lens, qsl], torch.int32, device)  # one copy
        return TritonAttnMetadata(
            slot_mapping=layout.slot_mapping,
            block_tables=bt,
            seq_lens=seq_lens,
            query_start_loc=qsl_t,
            max_query_len=max(qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)),
        )

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonAttnMetadata, layer: int = 0, sinks=None) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]; caches: [KVH, num_blocks, block_size, D]; sinks: [H] fp32 or None
        ks, vs = self._scales(layer)
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        attend = prefill_attention if meta.max_query_len > PREFILL_TILE_MIN_QUERY else paged_attention
        return attend(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            k_scale=ks,
            v_scale=vs,
            max_query_len=meta.max_query_len,
            window=self.window(layer),
            softcap=self.softcap,
            sinks=sinks,
        )


class TorchAttention(_KVScales):
    """Reference backend. KV layout per layer: [kv_heads, num_blocks, block_size, head_dim]."""

    def __init__(self, block_size: int, scale: float):
        self.block_size = block_size
        self.scale = scale
        # Reused gather buffer. Fresh multi-MB allocations per layer cost page faults that made
        # decode gathers 2x slower on CPU.
        self._workspace: torch.Tensor | None = None
        self.native: NativeAttention | None = None  # the CPU kernel (build_attention): used once it is loaded

    # ---- once per step -------------------------------------------------------------------
    def build(self, layout: StepLayout, device) -> TorchAttnMetadata:
        qsl, lens, tables, bs = layout.query_start_loc, layout.seq_lens, layout.block_tables, self.block_size
        dec = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
        native = None
        take = range(len(lens)) if NATIVE_PREFILL else dec
        if take and self.native is not None and self.native.lib is not None:  # one call: every sequence it takes
            nblk = max((len(tables[i]) for i in take), default=0)
            rows = [r for i in take for r in range(qsl[i], qsl[i + 1])]
            native = _Native(
                rows=None if len(rows) == qsl[-1] else torch.tensor(rows),
                tables=torch.tensor([tables[i] + [0] * (nblk - len(tables[i])) for i in take], dtype=torch.int32),
                ctx=torch.tensor([lens[i] for i in take], dtype=torch.int32),
                qsl=torch.tensor([0, *itertools.accumulate(qsl[i + 1] - qsl[i] for i in take)], dtype=torch.int32),
            )
            if native.rows is None:
                return TorchAttnMetadata(layout.slot_mapping, [], [], native)
            dec = []
        dec.sort(key=lambda i: len(tables[i]))
        decodes = []
        for bucket in _length_buckets([len(tables[i]) for i in dec]):
            idx = [dec[j] for j in bucket]
            nblk = len(tables[idx[-1]])
            blocks = torch.tensor([b for i in idx for b in tables[i] + [0] * (nblk - len(tables[i]))])
            ctx = torch.tensor([lens[i] for i in idx])
            mask = torch.arange(nblk * bs)[None, :] < ctx[:, None]  # [G, L]
            decodes.append(
                _Decodes(
                    rows=torch.tensor([qsl[i] for i in idx]).to(device),
                    blocks=blocks.to(device),
                    mask=mask[None, :, None, :].to(device),
                    ctx=ctx.to(device),
                )
            )
        prefills = []
        for i in range(len(lens)):
            n = qsl[i + 1] - qsl[i]
            if n == 1:
                continue
            mask = None
            if n != lens[i]:  # earlier context: SDPA's is_causal would align the wrong corner
                mask = _chunk_mask(lens[i], n, None, device)
            prefills.append(_Prefill(qsl[i], n, lens[i], torch.tensor(tables[i]).to(device), mask))
        return TorchAttnMetadata(layout.slot_mapping, decodes, prefills, native)

    # ---- per layer -------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchAttnMetadata,
        layer: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]; caches: [KVH, num_blocks, block_size, D]; sinks: [H] fp32 (GPT-OSS: a
        # logit per head in each softmax's denominator, with no value) or None
        kvh = k.shape[1]
        ks, vs = self._scales(layer)
        n = meta.native
        # the C kernel writes the new rows itself, in the call that reads them (not an fp8 cache: torch quantizes)
        fused = NATIVE_WRITE and n is not None and k.dtype == k_cache.dtype and k_cache.dtype in NATIVE_WRITES
        if not fused:
            reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        window = self.window(layer)
        if n is not None:
            qn = q if n.rows is None else q[n.rows]
            kw = dict(k=k, v=v, slots=meta.slot_mapping) if fused else {}
            o = self.native(qn, k_cache, v_cache, n.tables, n.ctx, n.qsl, self.scale, ks, vs, window, self.softcap,
                            sinks, **kw)  # fmt: skip
            if n.rows is None:  # every row, in order (no gather, no scatter)
                return o.to(q.dtype)
        out = torch.empty_like(q)
        if n is not None:
            out[n.rows] = o.to(q.dtype)
        for g in meta.decodes:
            kg, vg = self._gather(k_cache, v_cache, g.blocks, g.rows.numel(), q.dtype, ks, vs)
            out[g.rows] = self._decode(q[g.rows], kg, vg, g.mask_for(window), sinks)
        for p in meta.prefills:
            qp = q[p.start : p.start + p.num_q].transpose(0, 1)[None]  # [1, H, n, D]
            if p.num_q == p.ctx and k.dtype == k_cache.dtype:  # the whole context is new: the cache holds just this
                kp, vp = (x[p.start : p.start + p.num_q].transpose(0, 1)[None] for x in (k, v))  # [1, KVH, ctx, D]
            else:
                kg, vg = self._gather(k_cache, v_cache, p.blocks, 1, q.dtype, ks, vs)  # [KVH, 1, nblk * bs, D]
                kp, vp = kg[:, :, : p.ctx].transpose(0, 1), vg[:, :, : p.ctx].transpose(0, 1)  # [1, KVH, ctx, D]
            mask = _chunk_mask(p.ctx, p.num_q, window, q.device) if window else p.mask
            if self.softcap or sinks is not None:  # SDPA has neither soft-cap nor sinks: the same math spelled out
                o = self._explicit(qp, kp, vp, mask, sinks)
            else:
                o = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=kvh != q.shape[1]
                )
            out[p.start : p.start + p.num_q] = o[0].transpose(0, 1)
        return out

    def _explicit(self, q, k, v, mask, sinks):
        """Soft-capped attention and/or attention with sinks. q: [1, H, n, D]; k, v: [1, KVH, ctx, D]; mask: [n, ctx]
        bool or None (causal); sinks: [H] or None. In query slices whose scores stay under EXPLICIT_SCORES values:
        a long chunk's [H, n, ctx] fp32 scores (and their softmax's copies) would take gigabytes."""
        h, n, ctx = q.shape[1], q.shape[2], k.shape[2]
        rep = h // k.shape[1]
        k, v = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
        mask = _chunk_mask(ctx, n, None, q.device) if mask is None else mask
        rows = None if sinks is None else sinks.view(1, -1, 1, 1)
        step = max(1, EXPLICIT_SCORES // (h * ctx))
        out = torch.empty_like(q)
        for r in range(0, n, step):
            s = torch.matmul(q[:, :, r : r + step].float(), k.transpose(-1, -2)) * self.scale  # [1, H, rows, ctx]
            if self.softcap:
                s = self.softcap * torch.tanh(s / self.softcap)
            probs = softmax_with_sinks(s.masked_fill(~mask[r : r + step], float("-inf")), rows)
            out[:, :, r : r + step] = torch.matmul(probs, v).to(q.dtype)
        return out

    def _decode(self, q, k, v, mask, sinks=None):
        """Grouped-query attention for one query per sequence, as two batched matmuls with an fp32
        softmax: ~7x faster on CPU than SDPA's flash kernel at this shape.
        q: [G, H, D]; k, v: [KVH, G, L, D]; mask: [1, G, 1, L] -> [G, H, D]."""
        n, h, d = q.shape
        kvh = k.shape[0]
        # head h reads kv head h // rep: the rep query heads of a kv head become its query rows
        qg = q.view(n, kvh, h // kvh, d).transpose(0, 1).to(k.dtype)  # [KVH, G, rep, D]
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * self.scale  # [KVH, G, rep, L]
        if self.softcap:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        rows = None if sinks is None else sinks.view(kvh, 1, h // kvh, 1)  # head kv * rep + r, as q's rows
        probs = softmax_with_sinks(scores.masked_fill_(~mask, float("-inf")), rows).to(v.dtype)
        return torch.matmul(probs, v).transpose(0, 1).reshape(n, h, d).to(q.dtype)

    def _gather(self, k_cache, v_cache, blocks, n, dtype, k_scale=None, v_scale=None):
        """Copy the listed blocks of both caches into the workspace: ([KVH, n, L, D], same for V), in
        `dtype`; an fp8 cache is dequantized as x.float() * scale (the kernels' arithmetic).

        One index_select per kv head along its leading dim: the contiguous fast path, ~8x faster on
        CPU than index_select along dim 1 of the whole cache, 5x faster than slot by slot."""
        if k_cache.dtype == FP8:  # CPU index_select has no fp8 kernel: move the bytes, then dequantize
            kb, vb = self._gather(k_cache.view(torch.uint8), v_cache.view(torch.uint8), blocks, n, None)
            return ((kb.view(FP8).float() * k_scale).to(dtype), (vb.view(FP8).float() * v_scale).to(dtype))
        kvh, _, bs, d = k_cache.shape
        need = 2 * kvh * blocks.numel() * bs * d
        ws = self._workspace
        if ws is None or ws.numel() < need or ws.dtype != k_cache.dtype or ws.device != k_cache.device:
            ws = self._workspace = k_cache.new_empty(max(need, 2 * (ws.numel() if ws is not None else 0)))
        buf = ws[:need].view(2, kvh, blocks.numel(), bs, d)
        for i, cache in enumerate((k_cache, v_cache)):
            for h in range(kvh):
                torch.index_select(cache[h], 0, blocks, out=buf[i, h])
        k, v = buf[0].view(kvh, n, -1, d), buf[1].view(kvh, n, -1, d)
        return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))


def build_attention(spec, block_size: int, backend: str, native_dir: Path | None = None):
    """The attention backend for a model of `spec` (torch, or the Triton kernels), with its per-layer windows and
    Gemma 2's soft-cap: the engine's, a tensor-parallel rank's and the speculative draft's. `native_dir` (CPU only):
    where the C kernel is built and cached, for the torch backend; it is waited for (engine/cpu_native.py started
    the engine's while the weights loaded), so that every step takes it, the first as the later ones."""
    attn = (TritonAttention if backend == "triton" else TorchAttention)(
        block_size, spec.attn_scale or spec.head_dim**-0.5
    )
    attn.windows, attn.softcap = spec.layer_windows, spec.attn_softcap
    if native_dir is not None and backend != "triton":
        attn.native = NativeAttention.get(spec.head_dim, native_dir, wait=True)
    return attn


def softmax_with_sinks(s: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over s's last dim, fp32; with sinks (shaped to broadcast against s[..., :1]), each row's sink joins
    the denominator as one more logit whose value is dropped, as transformers' GPT-OSS."""
    if sinks is None:
        return s.float().softmax(-1)
    both = torch.cat([s.float(), sinks.float().expand(*s.shape[:-1], 1)], -1)
    return both.softmax(-1)[..., :-1]


def _chunk_mask(ctx: int, n: int, window: int | None, device) -> torch.Tensor:
    """[n, ctx] bool for a chunk of the last n of ctx positions: bottom-right causal (query j at position
    ctx - n + j sees positions <= its own), and within `window` positions of it when set."""
    q_pos = torch.arange(ctx - n, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window) if window else k_pos <= q_pos


def _length_buckets(nblks: list[int], max_buckets: int = 4, overhead: int = 64) -> list[range]:
    """Split sorted block counts into <= max_buckets runs of equal size, then merge neighbours while
    merging pads fewer than `overhead` extra blocks (the price of one more gather + matmul pair)."""
    n = len(nblks)
    if n == 0:
        return []
    edges = sorted({round(k * n / max_buckets) for k in range(max_buckets + 1)})
    runs = [range(a, b) for a, b in zip(edges, edges[1:])]
    merged = [runs[0]]
    for r in runs[1:]:
        prev = merged[-1]
        extra = len(prev) * (nblks[r[-1]] - nblks[prev[-1]])  # prev's rows padded up to r's max
        if extra < overhead:
            merged[-1] = range(prev.start, r.stop)
        else:
            merged.append(r)
    return merged
