"""Rank 0's side of tensor parallelism: the spawned ranks (`TPGroup`) and the runner that sends them each step's
descriptors before it runs them itself (`TPRunner`).

- Processes: one per extra rank (spawn), killed with rank 0 (PR_SET_PDEATHSIG) and on shutdown; a rank that
  exits, or a collective that waits past `distributed_timeout_s`, fails the engine with an error naming the rank.
- Step inputs: one small pickled descriptor per message through a pipe to each rank (the token ids, positions,
  cache slots of the flat batch: lists of ints; the block tables as deltas, tables.py), never a send per tensor.
  Waiting for the next step is a pipe read, so an idle worker waits as long as it likes; collectives run only
  inside a step.
- Messages are pickled once, on the sender's thread, with the standard pickler: torch's ForkingPickler (what
  Connection.send uses) would move any tensor through a shared-memory segment in /dev/shm, which a container may
  not have room for. A message that cannot be sent fails the engine, naming the rank.
- Collectives: the default process group, NCCL on GPUs, gloo on CPU (bf16 is reduced in fp32 there)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import pickle
import queue
import tempfile
import threading
import time
import weakref

import torch
import torch.distributed as dist

from engine.errors import ConfigError, EngineFault
from engine.parallel.rank import backend_for, join_group
from engine.parallel.tables import TableSender
from engine.parallel.worker import worker_main

log = logging.getLogger("engine")
_STOP = pickle.dumps(("stop",))


def start_ranks(cfg, device: torch.device, max_positions: int, timeline) -> TPGroup | NoRanks:
    """The other tensor-parallel ranks, started now so that they load their shards while this one loads its own;
    NoRanks at tensor_parallel_size 1."""
    if cfg.tensor_parallel_size == 1:
        return NoRanks()
    group = TPGroup(cfg, device, max_positions)
    timeline.mark("tensor-parallel ranks", f"{cfg.tensor_parallel_size} ranks, {backend_for(device)}")
    return group


class NoRanks:
    """Tensor parallelism off: no other rank to tell, wait for or stop."""

    send_seconds = 0.0

    def __init__(self):
        self.sent_bytes: collections.Counter[str] = collections.Counter()

    def expect(self, what: str, timeout_s: float) -> None:
        pass

    def send(self, msg: tuple) -> None:
        pass

    def starting(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def wrap(self, runner):
        return runner

    def shutdown(self) -> None:
        pass


class TPRunner:
    """Rank 0's runner under tensor parallelism: each forward pass and LM-head call goes to the other ranks first
    (the FlatBatch, or the rows), then runs here; they run the same on their shards, in step. A failure on the way
    stops every rank: the ranks may be out of step now, and the error names the rank that died."""

    def __init__(self, runner, group: TPGroup):
        self.runner, self.group = runner, group
        self.block_size = runner.block_size
        self.tables = TableSender()

    def forward(self, batch) -> torch.Tensor:
        try:
            delta = self.tables.delta(batch.block_tables)
            self.group.send(("forward", dataclasses.replace(batch, block_tables=[]), delta))
            return self.runner.forward(batch)
        except BaseException as e:
            self._fail(e)
            raise

    def logits(self, hidden: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
        try:
            self.group.send(("logits", None if rows is None or len(rows) == hidden.shape[0] else rows))
            return self.runner.logits(hidden, rows)
        except BaseException as e:
            self._fail(e)
            raise

    def _fail(self, e: BaseException) -> None:
        """Stop every rank and raise a fault naming the one that died; an interrupt, or a fault already raised on
        the way (a rank found dead), goes on as it is."""
        if isinstance(e, EngineFault):
            return
        why = f"a collective failed: {e}" if isinstance(e, RuntimeError) else f"a step was interrupted: {e!r}"
        fault = self.group.fault(why)
        if isinstance(e, Exception):
            raise fault from e


class TPGroup:
    """Rank 0's handle on the other ranks. Made before rank 0 loads its own shard; `setup` then `wait_ready`."""

    def __init__(self, cfg, device: torch.device, max_positions: int):
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
        self.send_errors: dict[int, BaseException] = {}  # rank -> why a message to it could not be written
        self._writers = [
            threading.Thread(target=self._write, args=(r, q, c), name=f"tp-send-{r}", daemon=True)
            for r, (q, c) in enumerate(zip(self._outboxes, self.conns), start=1)
        ]
        for t in self._writers:
            t.start()
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        self._init_group(device, init, tp)

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

    def _init_group(self, device: torch.device, init: str, tp: int) -> None:
        """Join the process group, watching the ranks: one that dies before it joins fails the start now, not
        after the timeout."""
        err: list[BaseException] = []

        def join() -> None:
            try:
                join_group(device, init, 0, tp, self.timeout_s)
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
        self.send_seconds = 0.0  # time spent pickling and queueing messages (bench/tp.py)
        self.sent_bytes: collections.Counter[str] = collections.Counter()  # pickled bytes per kind, once per message

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

    @contextlib.contextmanager
    def starting(self):
        """No rank outlives a failed start: every rank is stopped; a collective's error becomes a fault naming the
        rank that died."""
        try:
            yield
        except BaseException as e:
            fault = self.fault(f"the start failed: {e!r}")
            if isinstance(e, RuntimeError):
                raise fault from e
            raise

    # ---- steps ----------------------------------------------------------------------------------------------
    def wrap(self, runner) -> TPRunner:
        return TPRunner(runner, self)

    def send(self, msg: tuple) -> None:
        """The same message to every other rank, pickled once; a rank that has exited fails the engine here."""
        t = time.perf_counter()
        ranks = range(1, len(self.procs) + 1)
        for rank in ranks:
            self._check(rank)
        payload = self._pickle(msg)
        for rank in ranks:
            self._outboxes[rank - 1].put((msg[0], payload))
        self.send_seconds += time.perf_counter() - t

    def send_to(self, rank: int, msg: tuple) -> None:
        """A message for one rank (its part of a LoRA adapter), queued for its writer thread."""
        self._check(rank)
        self._outboxes[rank - 1].put((msg[0], self._pickle(msg, rank)))

    def _check(self, rank: int) -> None:
        if self.closed:
            raise EngineFault("tensor parallelism: the ranks were stopped after an earlier fault")
        p = self.procs[rank - 1]
        if not p.is_alive():
            raise self.fault(f"exited (code {p.exitcode})", rank)

    def _pickle(self, msg: tuple, rank: int | None = None) -> bytes:
        """The message as bytes; one that cannot be pickled would leave the ranks out of step: the engine fails."""
        try:
            payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise self.fault(f"could not pickle a {msg[0]!r} message: {e!r}", rank) from e
        self.sent_bytes[msg[0]] += len(payload)
        return payload

    def _write(self, rank: int, outbox: queue.SimpleQueue, conn) -> None:
        """A rank's writer: messages in order; ends after "stop" or when the rank's pipe breaks (it died). Any other
        error leaves the rank without a message it needs, out of step: the rank is killed, so that rank 0's next
        collective or send fails with a fault that says why, rather than waiting on a rank that waits for a step."""
        while True:
            kind, payload = outbox.get()
            try:
                conn.send_bytes(payload)
            except (OSError, EOFError):
                return
            except Exception as e:
                self.send_errors[rank] = e
                log.error("tensor-parallel rank %d: writing a %r message failed (%r); stopping the rank", rank, kind, e)
                _kill([self.procs[rank - 1]])
                return
            if kind == "stop":
                return

    def fault(self, what: str, rank: int | None = None) -> EngineFault:
        """An EngineFault naming the rank (the first one found dead when `rank` is None); every rank is stopped."""
        if rank is None:
            time.sleep(0.2)  # a rank that died mid-collective may still be exiting
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
            rank = dead[0][0] if dead else None
            what = f"{what} (rank {rank} exited with code {dead[0][1]})" if dead else what
        if rank in self.send_errors:
            what = f"{what}; a message to it could not be written: {self.send_errors[rank]!r}"
        self.shutdown()
        who = f"tensor-parallel rank {rank}" if rank is not None else "tensor parallelism"
        return EngineFault(f"{who}: {what}")

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for q in self._outboxes:
            q.put(("stop", _STOP))
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
