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
import queue
import tempfile
import threading
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


def rank_model(spec, rank: int, tp: int, dtype, device: torch.device, max_positions: int, quantization):
    """Rank `rank`'s model, not loaded yet: the shapes of its shard, and (tp > 1) the shard its checkpoint stream is
    cut to and its collectives. At tp 1, the whole model."""
    from engine.models import model_class
    from engine.parallel.shard import Shard, local_spec

    lspec = local_spec(spec, tp)
    model = model_class(lspec)(lspec, dtype, device, max_positions, quantization)
    if tp > 1:
        model.shard = Shard(spec, rank, tp)
        model.tp = TPComm(rank, tp, spec.vocab_size, backend_for(device) == "gloo")
    return model


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
        self.store = store
        self.closed = False
        # one writer thread per rank: a rank that stops reading (hung) blocks its writer, not the step loop, which
        # then fails in the step's first collective after the timeout
        self._outboxes = [queue.SimpleQueue() for _ in self.conns]
        self._writers = [
            threading.Thread(target=_write, args=(q, c), name=f"tp-send-{r}", daemon=True)
            for r, (q, c) in enumerate(zip(self._outboxes, self.conns), start=1)
        ]
        for t in self._writers:
            t.start()
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        self._init_group(backend_for(device), init, tp)

    def _watch(self) -> None:
        """Log a rank's death the moment it happens. On CPU the next collective fails with it; on GPUs an NCCL
        collective does not raise, and NCCL's watchdog ends this process after distributed_timeout_s: the log
        line says why."""
        while not self.closed:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive() and not self.closed:
                    log.error("tensor-parallel rank %d exited with code %s; the engine fails", rank, p.exitcode)
                    return
            time.sleep(1.0)

    def _init_group(self, backend: str, init: str, tp: int) -> None:
        """Join the process group, watching the ranks: one that dies before it joins fails the start now, not
        after the timeout."""
        err: list[BaseException] = []

        def join() -> None:
            try:
                dist.init_process_group(
                    backend, init_method=init, rank=0, world_size=tp, timeout=timedelta(seconds=self.timeout_s)
                )
            except BaseException as e:  # raised below, on the caller's thread
                err.append(e)

        t = threading.Thread(target=join, name="tp-init", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    raise self.fault(f"exited while starting (code {p.exitcode})", rank)
        if err:
            raise self.fault(f"could not join the process group: {err[0]}")
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
            try:
                msg = c.recv()
            except (EOFError, OSError):  # it died: its end of the pipe closed
                p.join(timeout=5)
                raise self.fault(f"exited while starting (code {p.exitcode})", rank) from None
            if msg[0] == "error":
                raise self.fault(f"failed while starting: {msg[1]}", rank)
            assert msg[0] == what, msg

    # ---- steps ----------------------------------------------------------------------------------------------
    def send(self, msg: tuple) -> None:
        """The same message to every other rank; a rank that has exited fails the engine here."""
        t = time.perf_counter()
        for rank in range(1, len(self.procs) + 1):
            self.send_to(rank, msg)
        self.send_seconds += time.perf_counter() - t

    def send_to(self, rank: int, msg: tuple) -> None:
        """A message for one rank (a step, or its part of a LoRA adapter), queued for its writer thread."""
        p = self.procs[rank - 1]
        if self.closed:
            raise EngineFault("tensor parallelism: the ranks were stopped after an earlier fault")
        if not p.is_alive():
            raise self.fault(f"exited (code {p.exitcode})", rank)
        self._outboxes[rank - 1].put(msg)

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
        for q in self._outboxes:
            q.put(("stop",))
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


def _write(outbox: queue.SimpleQueue, conn) -> None:
    """A rank's writer: messages in order; ends after "stop" or when the rank's pipe breaks (it died)."""
    while True:
        msg = outbox.get()
        try:
            conn.send(msg)
        except (OSError, EOFError):
            return
        if msg[0] == "stop":
            return


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
