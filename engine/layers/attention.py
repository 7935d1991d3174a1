"""Paged attention over the KV pool for a varlen batch that mixes prefill chunks and decodes.

The backend interface: `build(step) -> metadata` once per step, then `forward(layer, q, k, v, meta)`
per layer. The torch reference here defines correctness and is the CPU fast path: per layer it does
one cache write, then one gather + one SDPA call for the decode rows and one for the prefill rows,
never a Python loop over sequences."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StepLayout:
    """The flat batch's shape, as the model runner lays it out (all int64 tensors on the device)."""

    slot_mapping: torch.Tensor  # [T] cache slot for each new token
    query_start_loc: list[int]  # [B+1] token offsets of each sequence in the flat batch
    seq_lens: list[int]  # [B] context length after this step
    block_tables: list[list[int]]  # [B][blocks]


@dataclass
class _Group:
    """Sequences that share one SDPA call. Q rows are padded to the group's longest query."""

    rows: torch.Tensor  # [G, Qmax] flat token row per (seq, query); padding repeats a valid row
    valid: torch.Tensor | None  # [G, Qmax] bool, None when no padding (all queries of length Qmax)
    slots: torch.Tensor  # [G, L] cache slot of each context position
    mask: torch.Tensor  # [G, 1, Qmax, L] bool: key visible to query


@dataclass
class TorchAttnMetadata:
    slot_mapping: torch.Tensor
    groups: list[_Group]


class TorchAttention:
    """Reference backend. KV layout per layer: [num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, block_size: int, scale: float):
        self.block_size = block_size
        self.scale = scale

    def build(self, layout: StepLayout, device) -> TorchAttnMetadata:
        qsl, seq_lens = layout.query_start_loc, layout.seq_lens
        qlens = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]
        decode = [i for i, n in enumerate(qlens) if n == 1]
        prefill = [i for i, n in enumerate(qlens) if n > 1]
        groups = [self._group(idx, qsl, qlens, seq_lens, layout.block_tables, device)
                  for idx in (decode, prefill) if idx]
        return TorchAttnMetadata(layout.slot_mapping, groups)

    def _group(self, idx, qsl, qlens, seq_lens, block_tables, device) -> _Group:
        bs = self.block_size
        qmax = max(qlens[i] for i in idx)
        nblk = max(len(block_tables[i]) for i in idx)
        tables = torch.tensor([block_tables[i] + [0] * (nblk - len(block_tables[i])) for i in idx],
                              dtype=torch.int64)
        slots = (tables[:, :, None] * bs + torch.arange(bs)).view(len(idx), nblk * bs)  # [G, L]
        qlen = torch.tensor([qlens[i] for i in idx])
        start = torch.tensor([qsl[i] for i in idx])
        ctx = torch.tensor([seq_lens[i] for i in idx])
        qi = torch.arange(qmax)
        valid = qi[None, :] < qlen[:, None]  # [G, Qmax]
        qi_clamped = torch.minimum(qi[None, :], qlen[:, None] - 1)  # padding repeats the last query
        rows = start[:, None] + qi_clamped
        qpos = ctx[:, None] - qlen[:, None] + qi_clamped  # absolute position of each query
        mask = torch.arange(nblk * bs)[None, None, :] <= qpos[:, :, None]  # causal, within context
        return _Group(rows=rows.to(device), valid=None if bool(valid.all()) else valid.to(device),
                      slots=slots.to(device), mask=mask.unsqueeze(1).to(device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchAttnMetadata) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D]
        kvh, d = k.shape[1], k.shape[2]
        k_flat = k_cache.view(-1, kvh, d)
        v_flat = v_cache.view(-1, kvh, d)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
        out = torch.empty_like(q)
        for g in meta.groups:
            qg = q[g.rows].transpose(1, 2)  # [G, H, Qmax, D]
            kg = k_flat[g.slots].transpose(1, 2).to(q.dtype)  # [G, KVH, L, D]
            vg = v_flat[g.slots].transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scale,
                                               enable_gqa=kvh != q.shape[1])
            o = o.transpose(1, 2)  # [G, Qmax, H, D]
            if g.valid is None:
                out[g.rows.reshape(-1)] = o.reshape(-1, *o.shape[2:])
            else:
                out[g.rows[g.valid]] = o[g.valid]
        return out
