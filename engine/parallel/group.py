"""Rank 0's side of tensor parallelism: the spawned ranks, the step descriptors they replay, and the collectives a
sharded model calls (`TPComm`).

- Processes: one per extra rank (spawn), killed with rank 0 (PR_SET_PDEATHSIG) and on shutdown; a rank that
  exits, or a collective that waits past `distributed_timeout_s`, fails the engine with an error naming the rank.
- Step inputs: one small pickled descriptor per message through a pipe to each rank (the token ids, positions,
  cache slots, block tables of the flat batch: lists of ints), never a send per tensor. Waiting for the next step
  is a pipe read, so an idle worker waits as long as it likes; collectives run only inside a step.
- Collectives: the default process group, NCCL on GPUs, gloo on CPU (bf16 is reduced in fp32 there)."""

from __future__ import annotations

import logging
import os
import tempfile
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.errors import ConfigError, EngineFault

log = logging.getLogger("engine")


class TPComm:
    """The collectives of one rank's sharded model. `seconds` adds up the time spent in them (CPU timing)."""

    def __init__(self, rank: int, tp: int, vocab_size: int, gloo: bool):
        self.rank, self.tp, self.vocab_size, self.gloo = rank, tp, vocab_size, gloo
        self.seconds = 0.0
        self.calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        if self.gloo and x.dtype in (torch.bfloat16, torch.float16):
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


class TPGroup:
    """Rank 0's handle on the other ranks. Made before rank 0 loads its own shard; `setup` then `wait_ready`."""

    def __init__(self, cfg, device: torch.device, max_positions: int):
        from engine.parallel.worker import worker_main

        if dist.is_initialized():
            raise ConfigError(
                "EngineConfig.tensor_parallel_size: another tensor-parallel engine is running in this process; "
                "shut it down (engine.shutdown()) before starting one"
            )
        tp = cfg.tensor_parallel_size
        fd, store = tempfile.mkstemp(prefix="rp-llm-tp-")
        os.close(fd)
        os.unlink(store)  # the file store must not exist yet
        init = f"file://{store}"
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        self.timeout_s = cfg.distributed_timeout_s
        for rank in range(1, tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=worker_main,
                args=(rank, tp, init, cfg, max_positions, child),
                name=f"tp-rank-{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _kill, list(self.procs))
        dist.init_process_group(
            backend_for(device), init_method=init, rank=0, world_size=tp, timeout=timedelta(seconds=self.timeout_s)
        )
        self.store = store
        self.closed = False
        self.send_seconds = 0.0  # time spent pickling and writing messages (bench/tp.py)

    # ---- start ---------------------------------------------------------------------------------------------
    def expect(self, what: str, timeout_s: float) -> None:
        """Wait for every rank to report `what` (loaded, ready); a rank's error or exit is raised here."""
        deadline = time.monotonic() + timeout_s
        for rank, (p, c) in enumerate(zip(self.procs, self.conns), start=1):
            while not c.poll(0.2):
                if not p.is_alive():
                    raise self.fault(f"exited while starting (code {p.exitcode})", rank)
                if time.monotonic() > deadline:
                    raise self.fault(f"did not report {what} within {timeout_s:.0f} s", rank)
            msg = c.recv()
            if msg[0] == "error":
                raise self.fault(f"failed while starting: {msg[1]}", rank)
            assert msg[0] == what, msg

    # ---- steps ----------------------------------------------------------------------------------------------
    def send(self, msg: tuple) -> None:
        """The same message to every other rank; a rank that has exited fails the engine here."""
        t = time.perf_counter()
        for rank, (p, c) in enumerate(zip(self.procs, self.conns), start=1):
            if not p.is_alive():
                raise self.fault(f"exited (code {p.exitcode})", rank)
            try:
                c.send(msg)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                raise self.fault("closed its pipe", rank) from None
        self.send_seconds += time.perf_counter() - t

    def send_to(self, rank: int, msg: tuple) -> None:
        """A message for one rank (its part of a LoRA adapter)."""
        p, c = self.procs[rank - 1], self.conns[rank - 1]
        if not p.is_alive():
            raise self.fault(f"exited (code {p.exitcode})", rank)
        c.send(msg)

    def fault(self, what: str, rank: int | None = None) -> EngineFault:
        """An EngineFault naming the rank (the first one found dead when `rank` is None); every rank is stopped."""
        if rank is None:
            time.sleep(0.2)  # a rank that died mid-collective may still be exiting
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
            rank = dead[0][0] if dead else None
            what = f"{what} (rank {rank} exited with code {dead[0][1]})" if dead else what
        self.shutdown()
        who = f"tensor-parallel rank {rank}" if rank is not None else "tensor parallelism"
        return EngineFault(f"{who}: {what}")

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for c in self.conns:
            try:
                c.send(("stop",))
            except (OSError, EOFError):
                pass
        for p in self.procs:
            p.join(timeout=5)
        _kill(self.procs)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # a broken group: nothing left to do but forget it
                log.warning("destroying the tensor-parallel group: %s", e)
        try:
            os.unlink(self.store)
        except OSError:
            pass


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
