"""A tensor-parallel rank other than 0: its shard of the model and its own KV pool (the block tables are rank 0's,
so they are the same on every rank), replaying rank 0's forward passes. Messages, in order:

    ("setup", plan, calibration ids or None)  rank 0's MemoryPlan (per rank): allocate the KV pool, build attention
    ("forward", step)   run the model over the step rank 0 runs (ModelRunner.replay)
    ("logits", rows)    the LM head over those rows of the last hidden states; gathered to rank 0
    ("lora", slot, a, b)  this rank's part of an adapter, into a LoRA slot (before the step that uses it)
    ("stop",)

It reports ("loaded",), then ("ready",), or ("error", text) on its pipe."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

log = logging.getLogger("engine")


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when rank 0 dies, however it dies (no orphaned ranks)."""
    import ctypes

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


def _start(rank, tp, init_method, cfg, max_positions, conn):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from engine.device import model_dtype
    from engine.kv_cache import allocate, kv_scales
    from engine.layers.attention import build_attention
    from engine.model_runner import ModelRunner
    from engine.models.spec import ModelSpec
    from engine.parallel.group import backend_for, rank_model
    from engine.weights import iter_weights, read_json, resolve_model_path

    cuda = cfg.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(cfg.num_threads or max(1, (os.cpu_count() or 1) // tp))
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=tp,
        timeout=timedelta(seconds=cfg.distributed_timeout_s),
    )  # fmt: skip
    path = resolve_model_path(cfg)
    hf = read_json(path / "config.json")
    spec = ModelSpec.from_hf(hf, read_json(path / "generation_config.json"))
    dtype = model_dtype(cfg.dtype, hf, device.type)
    model = rank_model(spec, rank, tp, dtype, device, max_positions, cfg.quantization)
    lspec = model.spec
    model.load_weights(iter_weights(path, device))
    conn.send(("loaded",))
    msg = conn.recv()
    assert msg[0] == "setup", msg
    _, plan, calibration = msg
    kv_dtype = torch.float8_e4m3fn if cfg.kv_cache_dtype.startswith("fp8") else dtype
    kv = allocate(lspec, plan, kv_dtype, device)
    backend = cfg.kernel_backend if cfg.kernel_backend != "auto" else ("triton" if cuda else "torch")
    attn = build_attention(lspec, cfg.block_size, backend)
    if kv_dtype == torch.float8_e4m3fn:  # rank 0's rule; a calibration runs in step with rank 0's
        attn.set_kv_scales(*kv_scales(model, calibration, device))
    lora = None
    if cfg.enable_lora:
        from engine.lora.manager import LoRASlots

        lora = LoRASlots(cfg.max_loras, cfg.max_lora_rank, lspec, dtype, device)
    return ModelRunner(model, kv, attn, cfg.block_size, device, backend, lora, cfg.max_num_seqs, plan.max_model_len)


def _serve(runner, conn) -> None:
    import torch

    hidden = None
    with torch.inference_mode():
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # rank 0 is gone
                return
            if msg[0] == "forward":
                hidden = runner.replay(msg[1])
            elif msg[0] == "logits":
                rows = msg[1]
                runner.logits_local(hidden if rows is None else hidden[torch.tensor(rows, device=hidden.device)])
            elif msg[0] == "lora":
                runner.lora.load(msg[1], msg[2], msg[3])
            elif msg[0] == "stop":
                return
