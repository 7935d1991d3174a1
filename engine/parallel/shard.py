"""Which part of the model each tensor-parallel rank holds (Megatron's split, as vLLM shards the Llama family):

- column-parallel, no communication: q, k, v (a rank's heads) and gate, up (a slice of the intermediate size);
- row-parallel, all-reduced after: o_proj and down (the matching input columns);
- vocab-parallel: the embedding (rows; a token's row lives on one rank, the others add zeros) and the LM head
  (rows; each rank's logits are gathered to rank 0, the only one that samples);
- KV heads: split across ranks, or, with fewer KV heads than ranks, each rank keeps the one its query heads use;
- norms and q/k norms are whole on every rank; fp8 weight scales follow their rows (replicated for row-parallel
  weights, whose scales are per output row);
- mixture of experts: every rank holds every expert, each cut as a dense MLP is (gate / up rows and down columns of
  the expert's intermediate slice; the shared expert's likewise), the router whole; GPT-OSS's sinks follow their
  heads, and MXFP4 down weights are cut in whole 32-column blocks (bytes and scales);
- a row-parallel bias (o_proj, down: GPT-OSS) lives on rank 0 alone: the all-reduce would add it once per rank;
- a hybrid's Gated DeltaNet layers by key heads and the value heads they serve (out_proj row-parallel), so each
  rank's state pool holds its heads' states; its gated q_proj by whole heads (query and gate rows together).

Shape arithmetic, no torch at import: the memory planner (`python -m warmup.plan --tensor-parallel-size N`) plans
one rank from `local_spec`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from engine.errors import ConfigError
from engine.models.spec import ModelSpec


def check(spec: ModelSpec, tp: int, devices: int | None = None) -> None:
    """Refuse a size that cannot shard this model, with the reason."""
    if tp == 1:
        return
    why = []
    if spec.hybrid and spec.linear_attn.k_heads % tp:
        why.append(f"{spec.linear_attn.k_heads} linear-attention key heads are not divisible by {tp}")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(spec, name) % tp:
            why.append(f"{name} {getattr(spec, name)} is not divisible by {tp}")
    if spec.mxfp4 and (spec.moe_intermediate_size // tp) % 32:
        why.append(f"{spec.moe_intermediate_size // tp} expert columns per rank cut MXFP4's 32-value blocks")
    if spec.num_heads % tp:
        why.append(f"{spec.num_heads} attention heads are not divisible by {tp}")
    kv = spec.num_kv_heads
    if kv % tp and tp % kv:
        why.append(f"{kv} KV heads neither divide into {tp} ranks nor divide {tp} (to be replicated)")
    if spec.intermediate_size % tp:
        why.append(f"intermediate size {spec.intermediate_size} is not divisible by {tp}")
    if devices is not None and tp > devices:
        why.append(f"this machine has {devices} GPU{'s' if devices != 1 else ''}")
    why += _quant_cuts(spec, tp)
    if why:
        raise ConfigError(f"EngineConfig.tensor_parallel_size={tp}: cannot shard {spec.architecture}: {'; '.join(why)}")


def _quant_cuts(spec: ModelSpec, tp: int) -> list[str]:
    """A quantized checkpoint's shards must not cut a scale group (int) or a scale block (fp8), on either side."""
    q = spec.quant
    if q is None or not (q.kind == "int" or q.strategy == "block"):
        return []
    d = spec.head_dim
    rows = {
        "q": spec.num_heads * d // tp,
        "k/v": max(1, spec.num_kv_heads // tp) * d,
        "gate/up": spec.intermediate_size // tp,
    }
    cols = {"o_proj": spec.num_heads * d // tp, "down_proj": spec.intermediate_size // tp}
    if q.kind == "int":
        if q.desc_act:
            return [f"{q.source} act-order (desc_act / g_idx) checkpoints are not split over ranks yet"]
        unit = q.group_size or 32 // q.bits  # per channel: a row's one scale holds for any slice of its columns
        return [f"{name}'s {c} input columns per rank cut its {unit}-column quantization groups or packed words"
                for name, c in cols.items() if c % unit or c % (32 // q.bits)]  # fmt: skip
    bn, bk = q.block
    cut = [f"{name}'s {r} rows per rank cut its {bn}-row scale blocks" for name, r in rows.items() if r % bn]
    return cut + [f"{name}'s {c} input columns per rank cut its {bk}-column scale blocks"
                  for name, c in cols.items() if c % bk]  # fmt: skip


def local_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The shapes one rank's model has: its heads, KV heads, intermediate slice and vocabulary rows."""
    if tp == 1:
        return spec
    la = spec.linear_attn  # a hybrid's linear layers: their key and value heads (and so their state)
    return dataclasses.replace(
        spec,
        linear_attn=la and dataclasses.replace(la, k_heads=la.k_heads // tp, v_heads=la.v_heads // tp),
        num_heads=spec.num_heads // tp,
        num_kv_heads=max(1, spec.num_kv_heads // tp),
        intermediate_size=spec.intermediate_size // tp,
        moe_intermediate_size=spec.moe_intermediate_size // tp,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size // tp,
        vocab_size=-(-spec.vocab_size // tp),  # padded: the last rank's extra rows are zeros, cut after the gather
    )


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rank `rank` of `tp`, for the (full) `spec`."""

    spec: ModelSpec
    rank: int
    tp: int

    @property
    def vocab_rows(self) -> tuple[int, int]:
        n = -(-self.spec.vocab_size // self.tp)
        return self.rank * n, n

    def kv_heads(self) -> tuple[int, int]:
        """(first KV head, count) this rank keeps."""
        s, tp = self.spec, self.tp
        if s.num_kv_heads >= tp:
            n = s.num_kv_heads // tp
            return self.rank * n, n
        heads_per_rank, group = s.num_heads // tp, s.num_heads // s.num_kv_heads
        return (self.rank * heads_per_rank) // group, 1  # the KV head of this rank's query heads

    def weights(self, stream: Iterator) -> Iterator:
        """A checkpoint's (name, tensor) stream -> this rank's pieces, under the same names."""
        for name, t in stream:
            yield name, self.tensor(name, t)

    def tensor(self, name: str, t):
        import torch

        s, D = self.spec, self.spec.head_dim
        parts = name.split(".")
        proj, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, n = self.vocab_rows
            out = t.new_zeros((n, *t.shape[1:]))
            rows = t[start : start + n]
            out[: rows.shape[0]] = rows
            return out
        if (
            kind in ("k_scale", "v_scale")
            or t.dim() == 0
            or (t.numel() == 1 and kind in ("weight_scale", "input_scale"))
        ):
            return t  # per-tensor scales apply to every shard
        if kind in ("iq_weight", "iq_scales", "iq_zeros", "weight_scale_inv"):
            return self._quantized(proj, kind, t)
        if proj in ("o_proj", "down_proj", "w2") and kind == "bias":  # added after the all-reduce: once
            return t if self.rank == 0 else torch.zeros_like(t)
        if proj == "sinks":  # GPT-OSS: one per query head
            hq = s.num_heads // self.tp
            return t.narrow(0, self.rank * hq, hq)
        if ".experts." in name or "shared_expert." in name:
            return self._expert(name, proj, kind, t)
        if ".linear_attn." in name:
            return self._linear_attn(proj, t)
        column = self.column_rows()
        if proj in column:
            return t.narrow(0, *column[proj])
        if proj == "qkv_proj":  # Phi-3's fused q, k, v: each part sharded, fused again
            q, k, v = t.split([s.num_heads * D, s.num_kv_heads * D, s.num_kv_heads * D])
            parts = [q.narrow(0, *column["q_proj"]), k.narrow(0, *column["k_proj"]), v.narrow(0, *column["v_proj"])]
            return torch.cat(parts)
        if proj == "gate_up_proj":
            g, u = t.chunk(2)
            return torch.cat([g.narrow(0, *column["gate_proj"]), u.narrow(0, *column["up_proj"])])
        if proj in ("o_proj", "down_proj") and kind == "weight":  # input columns; scales are per output row
            return t.narrow(1, *self.row_columns()[proj])
        return t  # norms, q/k norms, row-parallel scales: whole on every rank

    def _expert(self, name: str, proj: str, kind: str, t):
        """An expert's (or the shared expert's) gate / up rows or down columns of its intermediate slice; MXFP4
        down bytes [H, I / 2] and scales [H, I / 32] by whole blocks (check() refused a cut through one)."""
        import torch

        s = self.spec
        inter = s.shared_expert_intermediate_size if "shared_expert." in name else s.moe_intermediate_size
        n = inter // self.tp
        if proj in ("gate_proj", "up_proj", "w1", "w3"):
            return t.narrow(0, self.rank * n, n)
        if proj in ("down_proj", "w2"):
            per = {"mx_scale": 32}.get(kind, 2 if t.dtype == torch.uint8 else 1)  # columns per stored value
            return t.narrow(1, self.rank * n // per, n // per)
        return t

    def _linear_attn(self, proj: str, t):
        """A hybrid's Gated DeltaNet layer (names as engine/models/qwen3_next.py arranges them) by heads: its key heads'
        q and k rows and the value heads they serve (v, z, b, a, dt_bias, A_log; the conv's channels as in_proj's
        q | k | v rows); out_proj's input columns; the gated norm (per value dim) whole."""
        import torch

        la, r = self.spec.linear_attn, self.rank
        kh, vh = la.k_heads // self.tp, la.v_heads // self.tp
        keys, values, heads = (r * kh * la.k_dim, kh * la.k_dim), (r * vh * la.v_dim, vh * la.v_dim), (r * vh, vh)
        if proj in ("in_proj_qkv", "conv1d"):
            q, k, v = t.split([la.k_heads * la.k_dim] * 2 + [la.v_heads * la.v_dim])
            return torch.cat([q.narrow(0, *keys), k.narrow(0, *keys), v.narrow(0, *values)])
        if proj == "in_proj_z":
            return t.narrow(0, *values)
        if proj in ("in_proj_b", "in_proj_a", "dt_bias", "A_log"):
            return t.narrow(0, *heads)
        return t.narrow(1, *values) if proj == "out_proj" else t

    def _quantized(self, proj: str, kind: str, t):
        """A packed or block-scaled tensor (engine/quant/): rows as the weight's for a column-parallel projection
        (block rows for block scales), input columns in words, groups or blocks for a row-parallel one (check()
        refused the sizes that would cut them)."""
        q = self.spec.quant
        column, row = self.column_rows(), self.row_columns()
        if kind == "weight_scale_inv":
            bn, bk = q.block
            if proj in column:
                start, n = column[proj]
                return t.narrow(0, start // bn, -(-n // bn))
            start, n = row[proj]
            return t.narrow(1, start // bk, -(-n // bk))
        if proj in ("qkv_proj", "gate_up_proj"):  # Phi-3's fused projections
            raise ConfigError(f"{q.source} checkpoints with fused {proj} are not split over ranks yet")
        if proj in column:
            return t.narrow(0, *column[proj])
        start, n = row[proj]
        if kind != "iq_weight" and q.group_size is None:
            return t  # per-channel scales and zeros: whole on every rank
        unit = 32 // q.bits if kind == "iq_weight" else q.group_size
        return t.narrow(1, start // unit, -(-n // unit))

    def column_rows(self) -> dict[str, tuple[int, int]]:
        """Column-parallel projections: the output rows this rank keeps, (start, size)."""
        s, D = self.spec, self.spec.head_dim
        hq, inter = s.num_heads // self.tp, s.intermediate_size // self.tp
        kv0, kvn = self.kv_heads()
        q = 2 * hq * D if s.attn_gate else hq * D  # a hybrid's q_proj: each head's query, then its gate
        return {
            "q_proj": (self.rank * q, q),
            "k_proj": (kv0 * D, kvn * D),
            "v_proj": (kv0 * D, kvn * D),
            "gate_proj": (self.rank * inter, inter),
            "up_proj": (self.rank * inter, inter),
        }

    def row_columns(self) -> dict[str, tuple[int, int]]:
        """Row-parallel projections: the input columns this rank keeps, (start, size)."""
        s, D = self.spec, self.spec.head_dim
        hq, inter = s.num_heads // self.tp, s.intermediate_size // self.tp
        return {"o_proj": (self.rank * hq * D, hq * D), "down_proj": (self.rank * inter, inter)}

    def lora(self, module: str, a, b):
        """A LoRA module's (A [r, in], B [out, r]) for this rank, as vLLM shards them: B's rows for a
        column-parallel projection, A's columns for a row-parallel one (its partial deltas are summed by the
        layer's all-reduce, with the partial outputs)."""
        if module in (rows := self.column_rows()):
            return a, b.narrow(0, *rows[module])
        return a.narrow(1, *self.row_columns()[module]), b
