"""What every tensor-parallel rank shares: its sharded model (`rank_model`), the collectives that model calls
(`TPComm`) and the process-group backend. Rank 0 (group.py) and the other ranks (worker.py) both import this."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.models import model_class
from engine.models.spec import ModelSpec
from engine.parallel.shard import Shard, local_spec


class TPComm:
    """The collectives of one rank's sharded model. `seconds` adds up the time spent in them (CPU timing)."""

    def __init__(self, rank: int, tp: int, vocab_size: int, gloo: bool):
        self.rank, self.tp, self.vocab_size, self.gloo = rank, tp, vocab_size, gloo
        self.seconds = 0.0
        self.calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        if self.gloo and x.dtype in (torch.bfloat16, torch.float16):  # gloo reduces no 16-bit floats
            y = x.float()
            dist.all_reduce(y)
            x = y.to(x.dtype)
        else:
            dist.all_reduce(x)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return x

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows, zeros for the others' tokens, summed over ranks. [T, hidden]"""
        n = weight.shape[0]
        local = ids - self.rank * n
        mine = (local >= 0) & (local < n)
        h = F.embedding(local.clamp(0, n - 1), weight) * mine[:, None].to(weight.dtype)
        return self.all_reduce(h)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[S, vocab / tp] on every rank -> [S, vocab] on rank 0 (the others get their own part back, unused)."""
        t = time.perf_counter()
        parts = [torch.empty_like(local) for _ in range(self.tp)] if self.rank == 0 else None
        dist.gather(local.contiguous(), parts, dst=0)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return torch.cat(parts, dim=-1)[:, : self.vocab_size] if self.rank == 0 else local


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(device: torch.device, init_method: str, rank: int, tp: int, timeout_s: float) -> None:
    """Join the default process group. On CUDA with device_id: NCCL forms its communicator now, at start, rather
    than at the first collective (the first request), so that an NCCL problem (P2P, shared memory) fails the start,
    not the first job after the worker said it was ready."""
    eager = {"device_id": torch.device("cuda", rank)} if device.type == "cuda" else {}
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=tp, timeout=timedelta(seconds=timeout_s),
        **eager,
    )  # fmt: skip


def rank_model(
    spec: ModelSpec, rank: int, tp: int, dtype, device: torch.device, max_positions: int, quantization: str | None,
    packed: bool = False,
):  # fmt: skip
    """Rank `rank`'s model, not loaded yet: the shapes of its shard, and (tp > 1) the shard its checkpoint stream is
    cut to and its collectives. At tp 1, the whole model. packed: a quantized checkpoint keeps its layout (the
    Triton backend runs it), else it is dequantized at load."""
    lspec = local_spec(spec, tp)
    parallel = {}
    if tp > 1:
        parallel = dict(
            shard=Shard(spec, rank, tp), tp=TPComm(rank, tp, spec.vocab_size, backend_for(device) == "gloo")
        )
    return model_class(lspec)(lspec, dtype, device, max_positions, quantization, packed=packed, **parallel)
