"""CUDA graphs for decode-only steps. At batch 1 an 8B model's decode step is hundreds of kernel launches, and
without a graph the GPU waits on Python between them; a graph replays them all with one call.

- What is captured: the model's forward (not the logits or the sampler) for a decode-only step of B sequences,
  one graph per bucket B in 1, 2, 4, 8, 16, 24, ... max_num_seqs (graph_buckets). A step of n decodes runs the
  smallest captured bucket >= n, its inputs padded: token 0 at position 0, cache slot -1 (writes nothing) and
  context length 0 (attention reads nothing).
- What runs eagerly: a step with a prefill chunk, a step with a LoRA adapter, a step larger than every captured
  bucket, and everything until its bucket is captured. The Triton attention's metadata lives in device tensors,
  so only that backend can be captured (the torch backend plans its gathers on the host).
- When: never on the cold-start path. `capture_next()` captures one bucket, smallest first; AsyncEngine calls it
  in the step loop's idle gaps after the worker is ready, LLM.generate before its first step.
- Memory: every bucket's graph shares one pool, sized by memory.graph_pool_bytes in the plan.

The graph object is injected (`new_graph`): CudaGraph on a GPU; the tests pass a stand-in that replays by
calling the captured function again, so everything here except the real capture runs on CPU."""

from __future__ import annotations

import bisect
import logging
import time

import torch

from engine.block_table import h2d
from engine.memory import graph_buckets

log = logging.getLogger("engine")


class CudaGraph:
    """torch.cuda.CUDAGraph over a pool shared by all buckets; replay() returns the captured output tensor."""

    def __init__(self, pool):
        self.pool = pool
        self.graph = self.out = None

    def capture(self, fn):
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (an adapter upload) during the capture is not an error
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            self.out = fn()
        return self.out

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class ReplayGraph:
    """The plain stand-in for CPU benches (`bench/decode_step.py --tiny`): capture runs fn once and keeps it, replay
    runs it again, so wrong copies into the static buffers or wrong padding give wrong tokens here too. It checks
    nothing else: a host sync, or a replay that reads other buffers than the capture did, passes here (the tests
    use tests/graph_standin.py's SyncCheckedGraph, which refuses both)."""

    def capture(self, fn):
        self.fn = fn
        return fn()

    def replay(self) -> torch.Tensor:
        return self.fn()


def cuda_graph_factory():
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraph(pool)


class DecodeGraphs:
    """Static input buffers, one graph per captured bucket, and the choice of bucket for a step.

    forward(ids, positions, slots, block_tables, seq_lens, query_start_loc) -> hidden [B, hidden] is the model's
    forward over those tensors (ModelRunner builds it); block_table is the runner's DeviceBlockTable, whose rows
    the graphs read in place."""

    def __init__(self, forward, block_table, max_num_seqs: int, device: torch.device, new_graph):
        self.forward, self.block_table, self.new_graph = forward, block_table, new_graph
        self.pending = list(graph_buckets(max_num_seqs))
        self.graphs: dict[int, object] = {}
        self.captured: list[int] = []  # sorted
        b = max_num_seqs
        # token ids, positions, cache slots; rows padded to 16 bytes so each row's pointer is aligned like the
        # eager path's (Triton specializes on it: another alignment would be another compile)
        self.inputs = torch.zeros((3, b + b % 2), dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)  # one token per sequence
        self.replays = 0  # decode steps served by a graph

    def _run(self, b: int) -> torch.Tensor:
        ids, pos, slots = self.inputs[0, :b], self.inputs[1, :b], self.inputs[2, :b]
        bt = self.block_table.table[:b]
        return self.forward(ids, pos, slots, bt, self.seq_lens[:b], self.query_start_loc[: b + 1])

    def capture_next(self) -> int | None:
        """Capture the smallest pending bucket; returns it, or None when all are captured."""
        if not self.pending:
            return None
        b = self.pending[0]
        self.inputs[:, :b] = 0
        self.inputs[2, :b] = -1  # every row is padding: no KV written, none read
        self.seq_lens[:b] = 0
        self._run(b)  # eager first: Triton compiles, lazily made buffers come from the normal allocator
        graph = self.new_graph()
        graph.capture(lambda: self._run(b))
        self.graphs[b] = graph
        bisect.insort(self.captured, b)
        self.pending.pop(0)
        return b

    def bucket(self, num_scheduled_tokens: list[int], uses_lora: bool) -> int | None:
        """The captured bucket a step may replay, or None: it runs eagerly."""
        n = len(num_scheduled_tokens)
        if uses_lora or any(t != 1 for t in num_scheduled_tokens):
            return None
        i = bisect.bisect_left(self.captured, n)
        return self.captured[i] if i < len(self.captured) else None

    def run(self, b: int, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int]):
        """Replay bucket b for n = len(ids) decodes (the block table already holds their rows): hidden [n, hidden]."""
        n, pad = len(ids), b - len(ids)
        dev = self.inputs.device
        self.inputs[:, :b].copy_(h2d([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad], torch.int64, dev))
        self.seq_lens[:b].copy_(h2d(seq_lens + [0] * pad, torch.int32, dev))
        self.replays += 1
        return self.graphs[b].replay()[:n]


class IdleWork:
    """What the step loop does in its idle gaps after ready, one piece per gap so a request never waits for more
    than one: compile the Triton variants a step can need (ModelRunner.warm: padding-only steps; CUDA only), then
    capture the pending CUDA graphs. A failure is logged and ends that kind of work: steps stay correct without it."""

    def __init__(self, runner, warm_kernels: bool):
        self.runner = runner
        self.warm_shapes = runner.warm_shapes() if warm_kernels else []

    @property
    def pending(self) -> bool:
        graphs = self.runner.graphs
        return bool(self.warm_shapes) or (graphs is not None and bool(graphs.pending))

    def step(self) -> None:
        if self.warm_shapes:
            self._warm()
        else:
            self.capture_next_graph()

    def _warm(self) -> None:
        shape = self.warm_shapes.pop(0)
        t0 = time.perf_counter()
        try:
            self.runner.warm(*shape)
        except Exception:
            log.exception("kernel warmup %s failed; kernels compile on first use instead", shape)
            self.warm_shapes.clear()
        if not self.warm_shapes:
            log.info("Triton kernels warm (the last shape took %.0f ms)", 1e3 * (time.perf_counter() - t0))

    def capture_next_graph(self) -> int | None:
        """Capture the next decode bucket's graph (smallest first); None when there is nothing left to capture."""
        graphs = self.runner.graphs
        if graphs is None or not graphs.pending:
            return None
        t0 = time.perf_counter()
        try:
            b = graphs.capture_next()
        except Exception:
            log.exception("CUDA graph capture failed; decode steps stay eager")
            graphs.pending.clear()
            return None
        log.info("CUDA graph for decode batch %d captured in %.0f ms", b, 1e3 * (time.perf_counter() - t0))
        return b

    def capture_graphs(self, batch: int) -> None:
        """Capture pending buckets, smallest first, until one holds `batch` decodes (LLM.generate, a batch API)."""
        graphs = self.runner.graphs
        while graphs is not None and graphs.pending and (not graphs.captured or graphs.captured[-1] < batch):
            if self.capture_next_graph() is None:
                return
