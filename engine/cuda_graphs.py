"""CUDA graphs for decode and verify steps. At batch 1 an 8B model's decode step is hundreds of kernel launches, and
without a graph the GPU waits on Python between them; a graph replays them all with one call.

- What is captured: the model's forward (not the logits or the sampler) for B sequences of Q query tokens each, one
  graph per (bucket B, query length Q): B in 1, 2, 4, 8, 16, 24, ... max_num_seqs (graph_buckets), Q in the
  runner's query lengths: 1 (decode); for the target with speculation, k + 1 (verification: a sequence's last token
  and its k drafts, memory.graph_query_lens); for a draft model, 1 and 2 (its one-token steps, and its catch-up
  after a speculating step, memory.DRAFT_GRAPH_QUERY_LENS). A step of n sequences of at most Q tokens each runs the
  smallest captured bucket >= n of the shortest such Q. Padding: a sequence with m < Q tokens has them in its last
  m query rows, and its first Q - m rows write no KV (cache slot -1) and are not returned. They sit at positions
  before its new tokens, where the cache holds its real KV, so causal attention over the sequence's context length
  gives the m real rows exactly their eager values. A padding sequence is token 0 at position 0, cache slot -1
  (writes nothing) and context length 0 (attention reads nothing).
- The inputs: token ids, positions, cache slots and context lengths go to static buffers in one copy per replay;
  the query offsets (Q per sequence) and the max query length are fixed per graph, the block tables are the
  runner's persistent device table. Up to GRAPH_MAX_QUERY query tokens the paged decode kernel runs, whose grid
  and split count follow from the shapes alone. Token ids may already be on the device (a draft model's previous
  picks): they are copied in on the device, so the host never waits for them.
- What runs eagerly: a step with a prefill chunk longer than the longest query length, a step with a LoRA
  adapter, a step larger than every captured bucket, and everything until its graph is captured. The Triton
  attention's metadata lives in device tensors, so only that backend can be captured (the torch backend plans
  its gathers on the host).
- When: never on the cold-start path. `capture_next()` captures one graph, smallest bucket first (its query
  lengths in order), as one piece of IdleWork (below): after the worker is ready, in the step loop's idle gaps and,
  while it is busy, within a share of its time; LLM.generate before its first step.
- Memory: every graph of one runner shares one pool (the target's, and a draft model's own), sized by
  memory.graph_pool_bytes in the plan.

The graph object is injected (`new_graph`): CudaGraph on a GPU; the tests pass a stand-in that replays by
calling the captured function again, so everything here except the real capture runs on CPU."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from engine.layers.dense import onednn_bf16, pack, pack_pieces
from engine.memory import graph_buckets
from kernels.cpu_gemm import ThinGemm
from kernels.cpu_layers import NativeLayers
from kernels.cpu_ops import CpuOps
from kernels.grammar_mask import apply_token_bitmask, new_bitmask

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
    """Static input buffers, one graph per captured (bucket, query length), and the choice of graph for a step.

    forward(ids, positions, slots, block_tables, seq_lens, query_start_loc, max_query_len) -> hidden [T, hidden] is
    the model's forward over those tensors (ModelRunner builds it); block_table is the runner's DeviceBlockTable,
    whose rows the graphs read in place. query_lens: the query lengths captured, 1 first."""

    def __init__(
        self, forward, block_table, max_num_seqs: int, device: torch.device, new_graph, query_lens=(1,), pad_slot=None
    ):
        """pad_slot: a hybrid model's spare state slot, which padding sequences use (None: no state slots)."""
        self.forward, self.block_table, self.new_graph, self.pad_slot = forward, block_table, new_graph, pad_slot
        self.query_lens = tuple(sorted(query_lens))
        self._sizes = graph_buckets(max_num_seqs)
        # (bucket, query length), smallest bucket first: a step of B sequences can use either once B's are in
        self.pending = [(b, q) for b in self._sizes for q in self.query_lens]
        self.graphs: dict[tuple[int, int], object] = {}
        self.buckets: dict[int, list[int]] = {q: [] for q in self.query_lens}  # query length -> captured, sorted
        b = max_num_seqs
        t = b * self.query_lens[-1]
        w = t + t % 2
        # token ids, positions, cache slots, then the padded row of each real token (int64 rows padded to 16 bytes,
        # so each row's pointer is aligned like the eager path's: Triton specializes on it, another alignment
        # would be another compile), then the context lengths (int32, 16-byte aligned too): views of one device
        # buffer, so a replay sends its inputs in one copy
        # (and a hybrid's state slots, int32)
        self._packed = torch.zeros(32 * w + 8 * b, dtype=torch.uint8, device=device)
        self.inputs = self._packed[: 32 * w].view(torch.int64).view(4, w)
        self.seq_lens = self._packed[32 * w : 32 * w + 4 * b].view(torch.int32)
        self.state_slots = self._packed[32 * w + 4 * b :].view(torch.int32)
        self._max = b
        # q query tokens per sequence: fixed per graph
        qsl = {q: torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=device) for q in self.query_lens}
        self.query_start_loc = qsl
        self.replays = 0  # steps served by a graph

    @property
    def captured(self) -> list[int]:
        """The decode (query length 1) buckets captured, sorted."""
        return self.buckets[1]

    def _run(self, b: int, q: int) -> torch.Tensor:
        ids, pos, slots = self.inputs[0, : b * q], self.inputs[1, : b * q], self.inputs[2, : b * q]
        bt = self.block_table.table[:b]
        state = () if self.pad_slot is None else (self.state_slots[:b],)
        return self.forward(ids, pos, slots, bt, self.seq_lens[:b], self.query_start_loc[q][: b + 1], q, *state)

    def capture_next(self) -> tuple[int, int] | None:
        """Capture the next pending graph; returns its (bucket, query length), or None when all are captured."""
        if not self.pending:
            return None
        b, q = key = self.pending[0]
        self.inputs[:3, : b * q] = 0
        self.inputs[2, : b * q] = -1  # every row is padding: no KV written, none read
        self.seq_lens[:b] = 0
        self.state_slots[:b] = -1 if self.pad_slot is None else self.pad_slot
        self._run(b, q)  # eager first: Triton compiles, lazily made buffers come from the normal allocator
        graph = self.new_graph()
        graph.capture(lambda: self._run(b, q))
        self.graphs[key] = graph
        bisect.insort(self.buckets[q], b)
        self.pending.pop(0)
        return key

    def covers(self, batch: int) -> bool:
        """Whether the graphs a step of `batch` sequences can use are captured (or will never be), at every query
        length: nothing pending up to the smallest bucket that holds it."""
        sizes = self._sizes
        need = next((b for b in sizes if b >= batch), sizes[-1])
        return not self.pending or self.pending[0][0] > need

    def bucket(self, num_scheduled_tokens: list[int], uses_lora: bool) -> tuple[int, int] | None:
        """The captured (bucket, query length) a step may replay, or None: it runs eagerly."""
        longest = max(num_scheduled_tokens)
        q = next((q for q in self.query_lens if q >= longest), None)
        if uses_lora or q is None:
            return None
        buckets = self.buckets[q]
        i = bisect.bisect_left(buckets, len(num_scheduled_tokens))
        return (buckets[i], q) if i < len(buckets) else None

    def run(self, key: tuple[int, int], batch, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay graph `key` = (bucket, query length) for `batch` (a FlatBatch; the block table already holds its
        rows): hidden [T, hidden] in the batch's token order. ids: its token ids already on the device, in place of
        batch.input_ids."""
        b, q = key
        qsl, split = batch.query_start_loc, self.inputs.numel() * 8
        n, t = len(qsl) - 1, qsl[-1]
        # staged whole in pinned memory (torch's caching host allocator keeps it until the copy is done): one
        # non-blocking copy straight into the static buffers; columns past b x q are read by no graph of bucket b
        host = torch.zeros(self._packed.shape, dtype=torch.uint8, pin_memory=self._packed.is_cuda)
        rows = host[:split].view(torch.int64).view(self.inputs.shape)
        rows[2, : b * q] = -1  # padding rows: token 0 at position 0, no cache slot (writes nothing)
        values = torch.tensor([batch.input_ids, batch.positions, batch.slots], dtype=torch.int64)  # [3, T]
        if q == 1:
            rows[:3, :t] = values
        else:  # sequence i's m tokens in its last m of q rows
            qsl_t = torch.tensor(qsl)
            m = qsl_t.diff()  # [n]
            seq = torch.repeat_interleave(torch.arange(n), m, output_size=t)  # [T] each token's sequence
            at = seq * q + q - m[seq] + torch.arange(t) - qsl_t[seq]  # [T] its padded row
            rows[:3].index_copy_(1, at, values)
            rows[3, :t] = at
        small = host[split:].view(torch.int32)  # context lengths (padding: 0), then state slots (padding: the spare)
        small[:n] = torch.tensor(batch.seq_lens, dtype=torch.int32)
        if self.pad_slot is not None:
            small[self._max : self._max + b] = self.pad_slot
            small[self._max : self._max + n] = torch.tensor(batch.state_slots, dtype=torch.int32)
        self._packed.copy_(host, non_blocking=True)
        at = self.inputs[3, :t]
        if ids is not None and q == 1:  # after the copy above on the same stream: over the host's placeholders
            self.inputs[0, :t].copy_(ids)
        elif ids is not None:
            self.inputs[0].index_copy_(0, at, ids)
        self.replays += 1
        out = self.graphs[key].replay()
        return out[:t] if q == 1 else out.index_select(0, at)


# While requests run, idle work takes at most this share of the loop's time (docs/decisions.md). A quarter: until
# it is done, requests may hit compiles and decodes run eagerly, so ending sooner is worth a larger share
BUSY_SHARE = 0.25
MASK_WARM_ROWS = (1, 2, 16)  # xgrammar's CUDA mask kernel specializes its row count: == 1, other, % 16 == 0


class IdleWork:
    """Off-request work after ready, in pieces: on CPU, pack the bf16 linear weights for oneDNN, a layer a piece
    (engine/layers/dense.py `pack`); compile the Triton variants a step can need (ModelRunner.warm:
    padding-only steps, with LoRA's too when it is on; then, once a grammar exists, xgrammar's mask kernel over 1, 2
    and 16 rows; CUDA only), then capture the pending CUDA graphs, smallest bucket first: the target's, and a draft
    model's after the target's of the same bucket.

    When (docs/decisions.md): the step loop runs one piece per idle gap, so a request that arrives waits for at
    most one; and while requests run, one piece after a step once the time since the last piece ended is at least
    (1 - share) / share times that piece's duration, so pieces take at most `share` of the busy loop and all of
    them are done within their own total time / share of serving, however busy. Every piece is safe between
    steps: it writes no KV (cache slot -1), reads none (context 0) and touches only the graphs' static buffers.
    A failure is logged and ends that kind of work: steps stay correct without it."""

    def __init__(
        self, runner, warm_kernels: bool, grammar=None, share: float = BUSY_SHARE, clock=time.perf_counter, draft=None,
        host=(),
    ):  # fmt: skip
        """grammar: the engine's StructuredOutputs (its mask pieces wait for its first compiled grammar). draft: the
        draft model's ModelRunner, whose graphs are captured with the target's. host: callables run first, one a
        piece (what a later request would otherwise pay for, kept off the cold start)."""
        self.runner, self.grammar, self.share, self.clock = runner, grammar, share, clock
        self.runners = [runner] + ([draft] if draft is not None else [])
        self.warm_shapes = runner.warm_shapes() if warm_kernels else []  # ModelRunner.warm's arguments
        # host pieces first (add(): imports and chat-template compiles the serving path needs later, not before ready)
        self.host: list[Callable[[], object]] = list(host)
        # True: only the host pieces run. A worker holds the rest until it takes jobs: packing, on both cores, made
        # the runpod SDK's import (0.5 s alone) take 1.1 s, so the first job-take came that much later.
        self.held = False
        self.pack = [piece for r in self.runners for piece in pack_pieces(getattr(r, "model", None))]  # CPU bf16
        self.packed = 0  # bytes
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
        if self.held:
            return bool(self.host)
        return bool(self.host or self.pack or self.warm_shapes or self.mask_rows) or any(g.pending for g in self.graphs)

    @property
    def graphs(self) -> list:
        """Each runner's DecodeGraphs (read now: graphs may be enabled after this was made)."""
        return [r.graphs for r in self.runners if r.graphs is not None]

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
        if self.host:
            self._host()
        elif self.pack:
            self._pack()
        elif self.warm_shapes:
            self._warm()
        elif self.mask_rows:
            self._warm_mask()
        else:
            self.capture_next_graph()
        end = self.clock()  # host time: a capture syncs first, a warm step's kernels may still be running on a GPU
        self._next_busy = end + (end - t0) * (1 - self.share) / self.share
        self.pieces += 1
        self.seconds += end - t0
        if not self.pending and not self.held:
            log.info("idle work done: %d pieces in %.2f s", self.pieces, self.seconds)

    def drain(self, batch: int | None = None) -> None:
        """Run the pieces now: every kernel piece, then the graph captures (up to one holding `batch` decodes when
        given), and wait for the CPU kernels' builds (the attention's was waited for at start: build_attention).
        LLM.generate before its first step; python -m warmup, so the volume's caches hold them all."""
        for native in (ThinGemm.current(), CpuOps.current(), NativeLayers.current()):  # packing: the GEMM's copies
            if native is not None:
                native.wait()
        while self.pending and (self.host or self.pack or self.warm_shapes or self.mask_rows or batch is None):
            self.step()
        if batch is not None:
            self.capture_graphs(batch)

    def add(self, *pieces: Callable[[], object]) -> None:
        """Host pieces, run before the rest (the step loop's thread: AsyncEngine.warm_later hands them over)."""
        self.host.extend(pieces)

    def _host(self) -> None:
        piece = self.host.pop(0)
        try:
            piece()
        except Exception:  # what it prepares is then done by the first request that needs it
            log.exception("idle piece %s failed; the first request that needs it does it", piece)

    def _pack(self) -> None:
        piece = self.pack.pop(0)
        done = pack(piece)
        self.packed += done
        if not done:
            self.pack.clear()
        elif not self.pack:
            thin = ThinGemm.loaded()
            how = ("AVX2 panels" if not onednn_bf16() else "oneDNN" if thin is None or not thin.every_row else
                   "thin GEMM")  # fmt: skip
            log.info("CPU linear weights packed (%s): %d MiB", how, self.packed >> 20)

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
            dev, vocab = self.runner.device, self.grammar.vocab_size
            logits = torch.zeros(rows, vocab, dtype=torch.float32, device=dev)
            apply_token_bitmask(logits, new_bitmask(rows, vocab, dev), list(range(rows)))
        except Exception:
            log.exception("grammar mask warmup over %d rows failed; it compiles on first use instead", rows)
            self.mask_rows.clear()

    def capture_next_graph(self) -> tuple[int, int] | None:
        """Capture the next graph: the smallest pending bucket of any runner (the target's first on a tie); returns
        its (bucket, query length), None when there is nothing left to capture."""
        pending = [g for g in self.graphs if g.pending]
        if not pending:
            return None
        graphs = min(pending, key=lambda g: g.pending[0][0])
        draft = " (draft model)" if graphs is not self.runner.graphs else ""
        t0 = time.perf_counter()
        try:
            b, q = graphs.capture_next()
        except Exception:
            log.exception("CUDA graph capture failed%s; its steps stay eager", draft)
            graphs.pending.clear()
            return None
        log.info("CUDA graph for batch %d x %d tokens%s captured in %.0f ms", b, q, draft,
                 1e3 * (time.perf_counter() - t0))  # fmt: skip
        return b, q

    def capture_graphs(self, batch: int) -> None:
        """Capture pending graphs, smallest bucket first, until those a step of `batch` sequences can use are in
        (LLM.generate, a batch API)."""
        while not all(g.covers(batch) for g in self.graphs):
            self.capture_next_graph()  # a failed capture clears its runner's pending graphs: that one covers then
