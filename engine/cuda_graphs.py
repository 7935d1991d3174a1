"""CUDA graphs for decode-only steps. At batch 1 an 8B model's decode step is hundreds of kernel launches, and
without a graph the GPU waits on Python between them; a graph replays them all with one call.

- What is captured: the model's forward (not the logits or the sampler) for a decode-only step of B sequences,
  one graph per bucket B in 1, 2, 4, 8, 16, 24, ... max_num_seqs (graph_buckets). A step of n decodes runs the
  smallest captured bucket >= n, its inputs padded: token 0 at position 0, cache slot -1 (writes nothing) and
  context length 0 (attention reads nothing).
- What runs eagerly: a step with a prefill chunk, a step with a LoRA adapter, a step larger than every captured
  bucket, and everything until its bucket is captured. The Triton attention's metadata lives in device tensors,
  so only that backend can be captured (the torch backend plans its gathers on the host).
- When: never on the cold-start path. `capture_next()` captures one bucket, smallest first, as one piece of
  IdleWork (below): after the worker is ready, in the step loop's idle gaps and, while it is busy, within a share
  of its time; LLM.generate before its first step.
- Memory: every bucket's graph shares one pool, sized by memory.graph_pool_bytes in the plan.

The graph object is injected (`new_graph`): CudaGraph on a GPU; the tests pass a stand-in that replays by
calling the captured function again, so everything here except the real capture runs on CPU."""

from __future__ import annotations

import bisect
import logging
import time

import torch

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
        b, w = max_num_seqs, max_num_seqs + max_num_seqs % 2
        # token ids, positions, cache slots (int64 rows padded to 16 bytes, so each row's pointer is aligned like
        # the eager path's: Triton specializes on it, another alignment would be another compile), then the context
        # lengths (int32, 16-byte aligned too): views of one device buffer, so a replay sends its inputs in one copy
        self._packed = torch.zeros(24 * w + 4 * b, dtype=torch.uint8, device=device)
        self.inputs = self._packed[: 24 * w].view(torch.int64).view(3, w)
        self.seq_lens = self._packed[24 * w :].view(torch.int32)
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
        n, split = len(ids), self.inputs.numel() * 8
        # staged whole in pinned memory (torch's caching host allocator keeps it until the copy is done): one
        # non-blocking copy straight into the static buffers; columns past b are read by no graph of bucket b
        host = torch.zeros(self._packed.shape, dtype=torch.uint8, pin_memory=self._packed.is_cuda)
        rows = host[:split].view(torch.int64).view(self.inputs.shape)
        rows[:, :n] = torch.tensor([ids, positions, slots], dtype=torch.int64)
        rows[2, n:] = -1  # padding rows: token 0 at position 0, no cache slot (writes nothing), context 0
        host[split:].view(torch.int32)[:n] = torch.tensor(seq_lens, dtype=torch.int32)
        self._packed.copy_(host, non_blocking=True)
        self.replays += 1
        return self.graphs[b].replay()[:n]


# While requests run, idle work takes at most this share of the loop's time (docs/decisions.md). A quarter: until
# it is done, requests may hit compiles and decodes run eagerly, so ending sooner is worth a larger share
BUSY_SHARE = 0.25
MASK_WARM_ROWS = (1, 2, 16)  # xgrammar's CUDA mask kernel specializes its row count: == 1, other, % 16 == 0


class IdleWork:
    """Off-request work after ready, in pieces: compile the Triton variants a step can need (ModelRunner.warm:
    padding-only steps, with LoRA's too when it is on; then, once a grammar exists, xgrammar's mask kernel over 1, 2
    and 16 rows; CUDA only), then capture the pending CUDA graphs, smallest bucket first.

    When (docs/decisions.md): the step loop runs one piece per idle gap, so a request that arrives waits for at
    most one; and while requests run, one piece after a step once the time since the last piece ended is at least
    (1 - share) / share times that piece's duration, so pieces take at most `share` of the busy loop and all of
    them are done within their own total time / share of serving, however busy. Every piece is safe between
    steps: it writes no KV (cache slot -1), reads none (context 0) and touches only the graphs' static buffers.
    A failure is logged and ends that kind of work: steps stay correct without it."""

    def __init__(self, runner, warm_kernels: bool, grammar=None, share: float = BUSY_SHARE, clock=time.perf_counter):
        """grammar: the engine's StructuredOutputs (its mask pieces wait for its first compiled grammar)."""
        self.runner, self.grammar, self.share, self.clock = runner, grammar, share, clock
        self.warm_shapes = runner.warm_shapes() if warm_kernels else []  # ModelRunner.warm's arguments
        self.mask_rows: list[int] = []
        # True: the mask pieces are queued once the first grammar has compiled; None: queued already
        self._masks_due: bool | None = warm_kernels and grammar is not None
        self._next_busy = 0.0  # the clock reading after which a busy loop may run the next piece
        self.pieces = 0  # pieces run, and their seconds: the time this work costs (the log's done line)
        self.seconds = 0.0

    @property
    def pending(self) -> bool:
        if self._masks_due and self.grammar.compiles:
            self.warm_grammar()
        graphs = self.runner.graphs
        return bool(self.warm_shapes or self.mask_rows) or (graphs is not None and bool(graphs.pending))

    def warm_grammar(self) -> None:
        """Queue the mask pieces now, before any grammar exists (python -m warmup)."""
        if self.grammar is not None and self._masks_due is not None:
            self._masks_due, self.mask_rows = None, list(MASK_WARM_ROWS)

    def busy(self) -> bool:
        """After a step, with requests running: one piece if the busy share allows it now. True when one ran."""
        if self.clock() < self._next_busy or not self.pending:
            return False
        self.step()
        return True

    def step(self) -> None:
        """One piece: a kernel warm step, a mask warm, or one graph capture."""
        t0 = self.clock()
        if self.warm_shapes:
            self._warm()
        elif self.mask_rows:
            self._warm_mask()
        else:
            self.capture_next_graph()
        end = self.clock()  # host time: a capture syncs first, a warm step's kernels may still be running on a GPU
        self._next_busy = end + (end - t0) * (1 - self.share) / self.share
        self.pieces += 1
        self.seconds += end - t0
        if not self.pending:
            log.info("idle work done: %d pieces in %.2f s", self.pieces, self.seconds)

    def drain(self, batch: int | None = None) -> None:
        """Run the pieces now: every kernel piece, then the graph captures (up to one holding `batch` decodes when
        given). LLM.generate before its first step; python -m warmup, so the volume's Triton cache holds them all."""
        while self.pending and (self.warm_shapes or self.mask_rows or batch is None):
            self.step()
        if batch is not None:
            self.capture_graphs(batch)

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

    def _warm_mask(self) -> None:
        """The grammar masks' kernel over `rows` rows, as GrammarMasks.apply launches it: fp32 logits [rows, vocab]
        on the device, an all-allowed bitmask, every row indexed."""
        rows = self.mask_rows.pop(0)
        try:
            import xgrammar as xgr  # imported already where a grammar was compiled

            dev, vocab = self.runner.device, self.grammar.vocab_size
            logits = torch.zeros(rows, vocab, dtype=torch.float32, device=dev)
            mask = xgr.allocate_token_bitmask(rows, vocab)
            xgr.apply_token_bitmask_inplace(logits, mask.to(dev, non_blocking=True), indices=list(range(rows)))
        except Exception:
            log.exception("grammar mask warmup over %d rows failed; it compiles on first use instead", rows)
            self.mask_rows.clear()

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
