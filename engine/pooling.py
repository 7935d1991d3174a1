"""Embeddings. A request whose SamplingParams carry `pooling` runs its prompt's prefill, chunked and batched with
every other request by the same scheduler, and samples nothing: it finishes when its prompt is computed and its KV
blocks go back to the pool. Its prompt's final hidden states (after the model's last norm: HF's
`last_hidden_state`) pool into one vector, the way sentence-transformers pools them:

- `last`: the last token's state (Qwen3-Embedding, e5-mistral, gte-Qwen; vLLM's default for a decoder model);
- `mean`: the mean over the prompt's tokens, summed chunk by chunk (fp32);
- `cls`: the first token's state.

Then `dimensions` keeps the first k values (a Matryoshka model's truncation), and `normalize` scales to unit length.
`mean` and `cls` need every prompt position computed, so those requests neither take nor give prefix-cache hits
(LLMEngine.add_request); `last` uses the cache like any prompt (the last position is always computed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.types import PoolingParams


def needs_every_position(p: PoolingParams) -> bool:
    return p.pooling != "last"


def pool_chunk(req, normed: torch.Tensor, start: int, n: int) -> None:
    """A chunk of `req`'s prompt ran: positions [start, start + n), their normed states `normed` [n, hidden].
    Positions pooled before (a prefill recomputed after preemption) are not counted twice; at the prompt's end the
    vector is made and kept on the request (req.embedding, host floats)."""
    p = req.params.pooling
    new = max(req.num_pooled, start) - start  # the chunk's first row not pooled yet
    if p.pooling == "mean" and new < n:
        part = normed[new:].float().sum(0)
        req.pooled = part if req.pooled is None else req.pooled + part
    elif p.pooling == "cls" and start == 0 and req.pooled is None:
        req.pooled = normed[0].float()
    req.num_pooled = max(req.num_pooled, start + n)
    if start + n < req.num_prompt_tokens:
        return
    if p.pooling == "last":
        v = normed[n - 1].float()
    else:
        v = req.pooled / req.num_prompt_tokens if p.pooling == "mean" else req.pooled
    v = v[: p.dimensions] if p.dimensions else v
    v = torch.nn.functional.normalize(v, dim=0) if p.normalize else v
    req.embedding = v.cpu().tolist()


@dataclass(frozen=True)
class ModelPooling:
    """How a checkpoint says to pool: its sentence-transformers files, then its config."""

    pooling: str  # one of POOLINGS
    normalize: bool
    matryoshka: bool | list[int]  # True: any prefix length; a list: those lengths; False: not trained for it


def model_pooling(path: Path | str | None) -> ModelPooling:
    """sentence-transformers' modules.json (a Pooling module's config, a Normalize module) where the checkpoint
    has one; otherwise a decoder's default (last token, normalized), as vLLM's. Matryoshka: config.json's
    `matryoshka_dimensions` or `is_matryoshka` (vLLM's keys)."""
    root = Path(path) if path else None
    cfg = _json(root / "config.json") if root else {}
    dims = cfg.get("matryoshka_dimensions")
    matryoshka = list(dims) if isinstance(dims, list) else bool(cfg.get("is_matryoshka") or dims)
    modules = _json(root / "modules.json") if root else []
    if not isinstance(modules, list) or not modules:
        return ModelPooling("last", True, matryoshka)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m.get("path", "") for m in modules if isinstance(m, dict)}
    pooling = "last"
    if "Pooling" in kinds:
        st = _json(root / kinds["Pooling"] / "config.json")
        modes = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
        pooling = next((ours for key, ours in modes.items() if st.get(key)), "last")
    return ModelPooling(pooling, "Normalize" in kinds, matryoshka)


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
