"""Safetensors files laid out for loading without a copy: the files we write ourselves (the converted default
model, fp8 snapshots).

A CPU engine keeps a file's tensor as its parameter when the bytes already lie as the parameter holds them,
64-byte aligned (engine/models/loading.py `Kept`). safetensors' own writer starts the data 8 bytes past a 64-byte
boundary and orders tensors by name (k_proj, o_proj, q_proj, v_proj), so neither holds for what it writes. Here the
header is padded with spaces (the format allows it) so that the data starts on a 64-byte boundary, tensors
whose size is a multiple of 64 bytes come first (each then starts aligned: the format allows no gaps), and the
caller gives the order: the parts of a fused parameter one after the other, as the engine fuses them. The
result is a standard safetensors file: transformers and safe_open read it as any other."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

ALIGN = 64
_NAMES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.float64: "F64",
}


def write(path: Path, tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (in this order, except that sizes not a multiple of 64 bytes go last) to `path`."""
    items = [(name, t.detach().to("cpu").contiguous()) for name, t in tensors]
    items.sort(key=lambda it: it[1].numel() * it[1].element_size() % ALIGN != 0)  # stable: the caller's order
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # the data starts on a 64-byte boundary
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, t in items:
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
    os.replace(tmp, path)


def fused_order(name: str) -> tuple:
    """A sort key putting each layer's q, k, v and gate, up projections (weights, then biases and scales) next to
    one another in the engine's row order; every other tensor keeps its place after them (by name)."""
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "model" or parts[1] != "layers":
        return (-1, 0, name)  # the embedding and the final norm first
    rank = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 3, "up_proj": 4}.get(parts[-2], 5)
    return (int(parts[2]), parts[-1] != "weight", rank, name)
