"""A tensor-parallel rank other than 0: its shard of the model and its own KV pool (the block tables are rank 0's,
so they are the same on every rank), replaying rank 0's forward passes. Messages, in order:

    ("setup", plan, calibration ids or None)  rank 0's MemoryPlan (per rank): allocate the KV pool, build attention
    ("forward", batch, delta)  run the model over the FlatBatch rank 0 runs (ModelRunner.forward), its block tables
                        sent as a TableDelta and kept here, one list per table (tables.py)
    ("logits", rows)    the LM head over those rows of the last hidden states (None: all); gathered to rank 0
    ("lora", slot, blob)  this rank's part of an adapter (LoRASlots.pack's bytes), into a LoRA slot (before the
                        step that uses it)
    ("stop",)

It reports ("loaded",), then ("ready",), or ("error", text) on its pipe."""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import traceback
from dataclasses import replace

import torch

from engine.cpu_threads import default_threads
from engine.model_runner import ModelRunner
from engine.parallel.rank import join_group
from engine.parallel.tables import TableMirror
from engine.startup import build_rank, kv_prefaulter, load_rank, resolve

log = logging.getLogger("engine")


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when rank 0 dies, however it dies (no orphaned ranks)."""
    try:
        failed = ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0  # PR_SET_PDEATHSIG
        why = f"errno {ctypes.get_errno()}" if failed else ""
    except (OSError, AttributeError) as e:  # not Linux / no libc symbol
        failed, why = True, str(e)
    if failed:  # each rank is its own process: one line per rank, once
        log.warning("prctl(PR_SET_PDEATHSIG) failed (%s): this rank is not killed if rank 0 dies", why)


def worker_main(rank: int, tp: int, init_method: str, cfg, max_positions: int, conn) -> None:
    _die_with_parent()
    try:
        runner = _start(rank, tp, init_method, cfg, max_positions, conn)
    except Exception as e:  # reported to rank 0, which fails its start with it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        traceback.print_exc()
        sys.exit(1)
    conn.send(("ready",))
    _serve(runner, conn)


def _start(rank: int, tp: int, init_method: str, cfg, max_positions: int, conn) -> ModelRunner:
    """This rank's runner, built as rank 0 builds its own (engine/startup.py), with rank 0's memory plan."""
    facts = resolve(cfg, rank)
    if facts.device.type == "cuda":
        torch.cuda.set_device(facts.device)
    torch.set_num_threads(cfg.num_threads or default_threads(tp)[0])  # the machine's (or its quota's) share
    join_group(facts.device, init_method, rank, tp, cfg.distributed_timeout_s)
    model, _ = load_rank(cfg, facts, max_positions)
    conn.send(("loaded",))
    msg = conn.recv()
    assert msg[0] == "setup", msg
    _, plan, calibration = msg
    # On CPU its pool's first region and a chunk ahead are faulted in as rank 0's are; rank 0's block manager grows
    # the region, and its growth is not sent here, so blocks past it fault in on their first use, inside a step
    prefault = kv_prefaulter(cfg, facts, plan)
    return build_rank(cfg, facts, model, plan, calibration, prefault)  # fp8 KV calibration runs in step with rank 0's


def _serve(runner: ModelRunner, conn) -> None:
    hidden, mirror = None, TableMirror()
    with torch.inference_mode():
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # rank 0 is gone
                return
            if msg[0] == "forward":
                hidden = runner.forward(replace(msg[1], block_tables=mirror.tables(msg[2])))
            elif msg[0] == "logits":
                runner.logits(hidden, msg[1])
            elif msg[0] == "lora":
                runner.lora.load_bytes(msg[1], msg[2])
            elif msg[0] == "stop":
                return
