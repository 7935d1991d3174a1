"""A safetensors file's header, read and checked without the safetensors library: each tensor's name, offset,
size, dtype and shape, in file order (engine/weights/reader.py maps them; engine/weights/read_ahead.py stages them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from engine.errors import UnsupportedModelError


@dataclass(frozen=True)
class Entry:
    name: str
    start: int  # absolute offset of its bytes in the file
    nbytes: int
    dtype: str  # safetensors' name: BF16, F32, F8_E4M3, ...
    shape: tuple[int, ...]


def entries(f: Path) -> list[Entry]:
    """The tensors of a safetensors file, in file order, from its header alone; both paths rely on these checks:
    sizes match the dtypes and shapes, and the tensors cover the data exactly (as safetensors requires)."""
    try:
        with f.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        header.pop("__metadata__", None)
        out = []
        for name, m in header.items():
            begin, end = (int(x) for x in m["data_offsets"])
            out.append(Entry(name, 8 + size + begin, end - begin, m["dtype"], tuple(int(d) for d in m["shape"])))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, MemoryError) as e:
        raise UnsupportedModelError(f"{f} is not a readable safetensors file: {type(e).__name__}: {e}") from e
    length = f.stat().st_size
    if out and max(e.start + e.nbytes for e in out) != length:  # safetensors' rule: the data is covered, no more
        raise UnsupportedModelError(
            f"{f}: its tensors end at byte {max(e.start + e.nbytes for e in out)} of {length}: incomplete download, "
            "or not a safetensors file?"
        )
    for e in out:
        count = 1
        for d in e.shape:
            count *= d
        if e.dtype not in DTYPE_BYTES or e.nbytes != count * DTYPE_BYTES[e.dtype] or e.start + e.nbytes > length:
            raise UnsupportedModelError(
                f"{f}: tensor {e.name!r} ({e.dtype}, shape {list(e.shape)}, {e.nbytes} bytes at {e.start}) does not "
                f"fit its dtype or the file ({length} bytes): incomplete download, or an unsupported dtype?"
            )
    return sorted(out, key=lambda e: e.start)


DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "I16": torch.int16,
        "U16": torch.uint16,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I32": torch.int32,
        "U32": torch.uint32,
        "F32": torch.float32,
        "I64": torch.int64,
        "U64": torch.uint64,
        "F64": torch.float64,
    }[name]
