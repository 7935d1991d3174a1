"""Device slots for resident LoRA adapters, and loading them off the step loop.

- Slots: for each of our 4 fused linears (qkv, o_proj, gate_up, down), lora_a [L, S, n*R, in] (the n projections'
  A stacked along the rank) and lora_b [L, S, out, n*R] (block-diagonal: projection j's B in its output columns
  and rank block j), so one shrink + one expand per fused linear serves all its projections (S = max_loras,
  R = max_lora_rank; smaller ranks zero-padded; the scaling folded into B). fp32 on CPU (the bmm path computes
  in fp32), the model dtype on CUDA. A projection an adapter does not target stays zero.
- Loading: the first request naming an adapter starts a job on a small thread pool: resolve -> disk cache
  (S3 download once, single flight) -> PEFT tensors -> padded, scaled host tensors. The step loop never waits
  for it; the request stays queued (the scheduler skips it) while everyone else decodes.
- Admission (engine thread): a ready adapter takes a free slot, or evicts the least recently used slot that
  no running request uses (a slot in use is pinned). With every slot pinned, the request keeps waiting.
- A failed load, or one not ready after lora_load_timeout_s, fails only the requests that named it."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import safetensors.torch
import torch

from engine.errors import InvalidRequestError
from engine.lora.adapter import load_adapter, max_adapter_bytes, module_shapes
from engine.lora.disk_cache import AdapterDiskCache, cache_key
from engine.lora.source import AdapterRef, LoRALoadError, resolve
from engine.openmp import release_openmp_threads
from engine.parallel.shard import Shard
from kernels import add_lora, slot_groups

log = logging.getLogger("engine")

# our fused linears -> the PEFT projections they hold, in output-column order
FUSED = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoRASlots:
    """The device side: per fused linear, lora_a [L, S, n*R, in] and lora_b [L, S, out, n*R] (see above), and the
    step's delta function. Under tensor parallelism every rank has its own, with its shard's shapes."""

    def __init__(self, max_loras: int, max_rank: int, spec, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank, self.spec, self.device = max_loras, max_rank, spec, device
        self.w_dtype = torch.float32 if device.type == "cpu" else dtype
        S, R, L = max_loras, max_rank, spec.num_layers
        self.a, self.b = {}, {}
        for lin, (d_in, d_out, n) in self.fused_shapes().items():
            self.a[lin] = torch.zeros(L, S, n * R, d_in, dtype=self.w_dtype, device=device)
            self.b[lin] = torch.zeros(L, S, d_out, n * R, dtype=self.w_dtype, device=device)

    def fused_shapes(self) -> dict[str, tuple[int, int, int]]:
        """fused linear -> (in, out, number of projections)."""
        shapes = module_shapes(self.spec)
        return {lin: (shapes[ms[0]][0], sum(shapes[m][1] for m in ms), len(ms)) for lin, ms in FUSED.items()}

    def load(self, slot: int, a: dict, b: dict) -> None:
        for lin in FUSED:  # small (rank x width per layer); non_blocking from pinned memory on CUDA
            self.a[lin][:, slot].copy_(a[lin], non_blocking=True)
            self.b[lin][:, slot].copy_(b[lin], non_blocking=True)

    @staticmethod
    def pack(a: dict, b: dict) -> bytes:
        """Another rank's part as bytes (safetensors: any dtype, bf16 included), to go through its pipe: tensors
        would go through a shared-memory segment in /dev/shm, which is 64 MB in a default container, less than an
        8B model's rank-16 part."""
        return safetensors.torch.save({**{f"a.{k}": v for k, v in a.items()}, **{f"b.{k}": v for k, v in b.items()}})

    def load_bytes(self, slot: int, blob: bytes) -> None:
        """A part that `pack` made, on the rank it was cut for."""
        parts = safetensors.torch.load(blob)
        self.load(slot, *({lin: parts[f"{ab}.{lin}"] for lin in FUSED} for ab in "ab"))

    def host_tensors(self, ad, shard=None, pin: bool | None = None) -> tuple[dict, dict]:
        """An adapter (full shapes) -> this layout's padded host tensors: A [L, R, in], B [L, out, R] * scaling,
        cut to `shard`'s part under tensor parallelism. Pinned on CUDA unless `pin` is False."""
        R, L = self.max_rank, self.spec.num_layers
        pin = self.device.type == "cuda" and pin is not False
        a, b, where = {}, {}, {}
        shapes = module_shapes(self.spec)
        for lin, (d_in, d_out, n) in self.fused_shapes().items():
            a[lin] = torch.zeros(L, n * R, d_in, dtype=self.w_dtype, pin_memory=pin)
            b[lin] = torch.zeros(L, d_out, n * R, dtype=self.w_dtype, pin_memory=pin)
            col = 0
            for j, m in enumerate(FUSED[lin]):
                where[m] = (lin, j * R, col)  # its rank block and output columns in the fused tensors
                col += shapes[m][1]
        for (layer, m), (wa, wb) in ad.weights.items():
            if shard is not None:
                wa, wb = shard.lora(m, wa, wb)
            lin, r0, c0 = where[m]
            a[lin][layer, r0 : r0 + ad.rank] = wa  # [r, in]
            b[lin][layer, c0 : c0 + wb.shape[0], r0 : r0 + ad.rank] = wb * ad.scaling  # [out, r], scaled in fp32
        return a, b

    def delta(self, token_slot: torch.Tensor):
        """This step's delta function for the model: fn(layer, linear, x [T, in], out [T, N]) adds each token's
        adapter delta to our fused linear's output in place. token_slot: [T], -1 = no adapter."""
        # once per step, for 4L calls
        groups = slot_groups(token_slot, self.max_loras) if self.device.type != "cuda" else None

        def apply(layer: int, linear: str, x: torch.Tensor, out: torch.Tensor) -> None:
            add_lora(out, x, self.a[linear][layer], self.b[linear][layer], token_slot, groups=groups)

        return apply


KNOWN_ADAPTERS = 1024  # adapter names remembered (what /v1/models lists besides LORA_MODULES)
HOST_ADAPTERS = 8  # loaded adapters' host copies kept while they wait for a device slot


class LoRAManager:
    def __init__(self, cfg, spec, slots: LoRASlots, ranks=None):
        """`spec`: the full model's (adapters are checked against it); `slots`: rank 0's (its runner's). Under tensor
        parallelism `ranks` is the TPGroup: each load sends every other rank its part."""
        self.cfg, self.spec, self.slots = cfg, spec, slots
        tp = cfg.tensor_parallel_size
        self.ranks, self.shards = ranks, [Shard(spec, r, tp) for r in range(tp)] if tp > 1 else []
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # adapter key -> slot, least recently used first
        self.free_slots = list(range(cfg.max_loras))
        # adapter keys seen (for /v1/models), least recently requested first: at most KNOWN_ADAPTERS
        self.refs: OrderedDict[str, AdapterRef] = OrderedDict()
        self._jobs: dict[str, Future] = {}  # key -> host tensors being (or already) loaded
        self._started: dict[str, float] = {}
        self.disk = AdapterDiskCache.from_config(cfg, max_adapter_bytes(spec, cfg.max_lora_rank))
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lora-load", initializer=_lower_priority)
        self.num_loads = 0

    # ---- requests (engine thread) -----------------------------------------------------------
    def resolve(self, name: str, s3_uri: str | None = None) -> AdapterRef:
        """Name -> AdapterRef (raises InvalidRequestError naming the field). Safe from any thread."""
        return resolve(self.cfg, name, s3_uri)

    def request(self, ref: AdapterRef) -> str:
        """Note that a request needs `ref`; start loading it unless resident or loading. Returns its key."""
        key = cache_key(ref)
        self.refs.setdefault(key, ref)
        self.refs.move_to_end(key)
        if key not in self.slot_of and key not in self._jobs:
            self._started[key] = time.monotonic()
            self._jobs[key] = self._pool.submit(self._load, ref)
            self._bound(keep=key)
        return key

    def _bound(self, keep: str) -> None:
        """At most HOST_ADAPTERS loaded host copies wait for a slot (the oldest are dropped: a request still waiting
        for one loads it again, from the disk cache), and at most KNOWN_ADAPTERS names are remembered (never one
        resident or loading)."""
        done = [k for k, f in self._jobs.items() if k != keep and f.done() and f.exception() is None]
        for k in done[: max(0, len(done) - HOST_ADAPTERS)]:
            del self._jobs[k]
        idle = [k for k in self.refs if k not in self.slot_of and k not in self._jobs]  # least recent first
        for k in idle[: max(0, len(self.refs) - KNOWN_ADAPTERS)]:
            del self.refs[k]
            self._started.pop(k, None)

    def status(self, key: str, arrival: float) -> BaseException | None:
        """For a request still waiting on adapter `key`: the error that fails it, or None to keep waiting."""
        if key in self.slot_of:
            return None
        fut = self._jobs.get(key)
        if fut is None:  # loaded once, evicted since: load again
            if key not in self.refs:  # forgotten past KNOWN_ADAPTERS while it waited
                return LoRALoadError("the adapter was forgotten while this request waited (too many adapters)")
            self.request(self.refs[key])
            fut = self._jobs[key]
        if fut.done() and fut.exception() is not None:
            return fut.exception()
        if not fut.done() and time.monotonic() - max(arrival, self._started[key]) > self.cfg.lora_load_timeout_s:
            return LoRALoadError(
                f"adapter {self.refs[key].name!r} was not loaded within LORA_LOAD_TIMEOUT_S="
                f"{self.cfg.lora_load_timeout_s:g} s"
            )
        return None

    def forget_failed(self, key: str) -> None:
        """After its requests were failed: a later request retries the load from scratch."""
        fut = self._jobs.get(key)
        if fut is not None and fut.done() and fut.exception() is not None:
            del self._jobs[key]

    def acquire(self, key: str, pinned: set[int]) -> int | None:
        """The slot holding `key`, loading it into one if its host tensors are ready; None = not yet (still
        loading, or every slot is used by a running request). `pinned`: slots running requests use."""
        slot = self.slot_of.get(key)
        if slot is not None:
            self.slot_of.move_to_end(key)
            return slot
        fut = self._jobs.get(key)
        if fut is None or not fut.done() or fut.exception() is not None:
            return None
        if self.free_slots:
            slot = self.free_slots.pop(0)
        else:
            victim = next((k for k, s in self.slot_of.items() if s not in pinned), None)
            if victim is None:
                return None
            slot = self.slot_of.pop(victim)
            log.info("LoRA slot %d: evicting %r (least recently used)", slot, self.refs[victim].name)
        parts = fut.result()  # rank 0's (a, b), then each other rank's bytes
        self.slots.load(slot, *parts[0])
        for rank, blob in enumerate(parts[1:], start=1):  # before the step that uses it: the pipe keeps the order
            self.ranks.send_to(rank, ("lora", slot, blob))
        del self._jobs[key]  # the disk cache keeps the files; a later reload reads them again
        self.slot_of[key] = slot
        self.num_loads += 1
        log.info(
            "LoRA slot %d: %r loaded (%.2f s after first request)",
            slot,
            self.refs[key].name,
            time.monotonic() - self._started[key],
        )
        return slot

    # ---- the scheduler's admission gate (engine thread) ----------------------------------------------
    def can_start(self, req, running) -> bool:
        """Whether `req` can start now, changing nothing: its adapter is resident, or loaded and a slot is free or
        held by no running request (`running`: the running requests, whose slots are pinned)."""
        key = req.lora_key
        if key is None or key in self.slot_of:
            return True
        fut = self._jobs.get(key)
        if fut is None or not fut.done() or fut.exception() is not None:
            return False
        pinned = _pinned(running)
        return bool(self.free_slots) or any(s not in pinned for s in self.slot_of.values())

    def admit(self, req, running) -> None:
        """`req` starts: its adapter takes its slot (loaded into one now if it is not resident)."""
        if req.lora_key is not None:
            req.lora_slot = self.acquire(req.lora_key, _pinned(running))

    def refused(self, waiting) -> dict:
        """Waiting requests whose adapter failed to load (or not in time), with the error. The load is forgotten,
        so a later request retries it."""
        errors: dict[str, BaseException] = {}
        for req in waiting:
            key = req.lora_key
            if key is not None and key not in self.slot_of and key not in errors:
                if (err := self.status(key, req.arrival_time)) is not None:
                    errors[key] = err
        for key in errors:
            self.forget_failed(key)
        return {req: errors[req.lora_key] for req in waiting if req.lora_key in errors}

    def names(self) -> list[str]:
        return sorted({r.name for r in self.refs.values()} | {n for n, _ in self.cfg.lora_modules})

    def stats(self) -> dict:
        return {
            "lora_resident": len(self.slot_of),
            "lora_loading": sum(not f.done() for f in self._jobs.values()),
            "lora_loads": self.num_loads,
            **{f"lora_disk_{k}": v for k, v in self.disk.stats().items()},
        }

    # ---- loader threads ----------------------------------------------------------------------
    def _load(self, ref: AdapterRef) -> list:
        """Fetch (once) and load an adapter into padded host tensors: rank 0's (a, b), then under tensor parallelism
        each other rank's part packed as bytes (here, off the step loop). The thread's OpenMP pool, if its torch work
        made one, ends with the load (engine/openmp.py: a second pool makes the step loop's workers sleep)."""
        try:
            return self._host_parts(ref)
        finally:
            release_openmp_threads()

    def _host_parts(self, ref: AdapterRef) -> list:
        with self.disk.use(ref) as path:
            try:
                ad = load_adapter(path, self.spec, self.cfg.max_lora_rank, ref.name)
            except InvalidRequestError:
                if ref.is_s3:  # damaged past what the cache's check sees (NaN values): the next request fetches it
                    self.disk.drop(ref, unpin=True)
                raise
        if not self.shards:
            return [self.slots.host_tensors(ad)]
        others = [LoRASlots.pack(*self.slots.host_tensors(ad, s, pin=False)) for s in self.shards[1:]]
        return [self.slots.host_tensors(ad, self.shards[0]), *others]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _pinned(running) -> set[int]:
    return {r.lora_slot for r in running if r.lora_key is not None}


def _lower_priority() -> None:
    """Loader threads yield the CPU to the step loop (on a CPU-only box they compete with its torch threads).
    Linux: a thread's nice value is per thread id."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
