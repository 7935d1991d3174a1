"""One rank's model over one flat varlen batch: its weights, KV pool, attention backend and LoRA slots. The only
place that turns a step's host lists into tensors. Every tensor-parallel rank runs one (built by
engine/startup.py's `build_rank`); rank 0's steps reach it through engine/step_runner.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from engine.block_table import DeviceBlockTable, h2d, h2d_rows
from engine.cuda_graphs import DecodeGraphs
from engine.layers.attention import PREFILL_TILE_MIN_QUERY, StepLayout, TritonAttnMetadata
from kernels.fused_moe import LARGE_RUN

LORA_WARM_TOKENS = (1, 17, 64)  # step sizes whose LoRA kernel tiles are 16, 32 and 64 rows (kernels/lora.py)


@dataclass(frozen=True)
class FlatBatch:
    """One step's tokens as one varlen batch, in host lists: also the descriptor rank 0 sends every other rank
    under tensor parallelism, which runs the same forward pass on its shard. T tokens over B sequences."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slots: list[int]  # [T] KV cache slot: block id * block size + offset in the block
    query_start_loc: list[int]  # [B + 1] where each sequence's tokens start
    seq_lens: list[int]  # [B] each sequence's context length after this step
    block_tables: list[list[int]]  # [B] each sequence's KV block ids
    token_slot: tuple[int, ...] | list[int] = ()  # [T] each token's LoRA slot (-1: none); () when no token has one
    state_slots: tuple[int, ...] | list[int] = ()  # [B] a hybrid model's state slot per sequence; () for others

    @property
    def tokens_per_seq(self) -> list[int]:
        qsl = self.query_start_loc
        return [b - a for a, b in zip(qsl, qsl[1:])]


def flat_batch(items, block_size: int, token_slot=()) -> FlatBatch:
    """items: (request, first position, its token ids) per sequence -> their flat batch (cache slots from each
    request's block table)."""
    input_ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
    state = [req.state_slot for req, _, _ in items] if items and items[0][0].state_slot >= 0 else ()
    for req, start, ids in items:
        end = start + len(ids)
        input_ids += ids
        positions += range(start, end)
        table = req.block_ids
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        qsl.append(qsl[-1] + len(ids))
        seq_lens.append(end)
        tables.append(table)
    return FlatBatch(input_ids, positions, slots, qsl, seq_lens, tables, token_slot, state)


class ModelRunner:
    def __init__(
        self,
        model,
        kv_caches: torch.Tensor,
        attn,
        block_size: int,
        device: torch.device,
        kernel_backend: str = "torch",
        lora=None,
        max_num_seqs: int = 128,
        max_model_len: int = 2048,
        new_graph=None,
        graph_query_lens: tuple[int, ...] = (1,),
        state=None,
    ):
        """lora: this rank's LoRASlots (None: LoRA off). new_graph: make steps replay CUDA graphs, captured
        after ready by IdleWork, idle or busy (engine/cuda_graphs.py); None: every step runs eagerly.
        graph_query_lens: the query lengths graphs are captured for (memory.graph_query_lens). state: a hybrid
        model's StatePool (engine/state_cache.py), None for the others."""
        self.model = model
        self.state = state
        self.kernel_backend = kernel_backend
        self.kv_caches = kv_caches
        self.attn = attn
        self.block_size = block_size
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.lora = lora
        self.graph_query_lens = graph_query_lens
        # Triton attention reads block tables from a persistent device tensor; the torch backend plans on the host
        self.block_table = (
            DeviceBlockTable(max_num_seqs, -(-max_model_len // block_size), device)
            if kernel_backend == "triton"
            else None
        )
        self.graphs: DecodeGraphs | None = None
        if new_graph is not None:
            self.enable_graphs(new_graph)

    def enable_graphs(self, new_graph) -> DecodeGraphs:
        """Steps may replay CUDA graphs once theirs are captured (engine/cuda_graphs.py)."""
        if self.block_table is None:
            raise ValueError("CUDA graphs need the Triton attention backend")
        pad = None
        if self.state is not None:  # a hybrid's padding sequences write their state into a spare slot
            self.state = self.state.with_spare()
            pad = self.state.spare
        self.graphs = DecodeGraphs(
            self._forward, self.block_table, self.max_num_seqs, self.device, new_graph, self.graph_query_lens, pad
        )
        return self.graphs

    @torch.inference_mode()
    def forward(self, batch: FlatBatch, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The model over `batch`: a captured graph's replay when one fits, else eagerly. [T, hidden]
        ids: the step's input ids already on the device (a draft model's previous picks: the host need not wait for
        them), in place of batch.input_ids."""
        bt = self.block_table.update(batch.block_tables) if self.block_table is not None else None
        graphs = self.graphs
        key = graphs.bucket(batch.tokens_per_seq, bool(batch.token_slot)) if graphs is not None else None
        if key is not None:
            if self.state is not None:  # the graph reads its static slot indices; a new sequence's slot is cleared
                self.state.reset(batch.query_start_loc, batch.positions, batch.state_slots)
            return graphs.run(key, batch, ids)
        dev = self.device
        if ids is None:
            ids_t, pos_t, slots_t = h2d_rows([batch.input_ids, batch.positions, batch.slots], torch.int64, dev)
        else:
            ids_t, (pos_t, slots_t) = ids, h2d_rows([batch.positions, batch.slots], torch.int64, dev)  # one copy
        layout = StepLayout(
            slot_mapping=slots_t,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_tables=batch.block_tables,
            block_table=bt,
        )
        meta = self.attn.build(layout, dev)
        # a step without adapters pays nothing for LoRA
        lora = self.lora.delta(h2d(batch.token_slot, torch.int64, dev)) if batch.token_slot else None
        state = {}  # a hybrid's: each sequence's state slot
        if self.state is not None:
            state["state"] = self.state.batch(batch.query_start_loc, batch.positions, batch.state_slots)
        with kernels.backend(self.kernel_backend):
            return self.model(ids_t, pos_t, self.kv_caches, self.attn, meta, lora, **state)  # [T, hidden]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
        """The LM head over these rows of a step's hidden states (None: all of them): [rows, vocab] fp32. Under
        tensor parallelism every rank runs its part and rank 0 gets the whole vocabulary."""
        if rows is not None and len(rows) != hidden.shape[0]:
            hidden = hidden[h2d(rows, torch.int64, hidden.device)]
        with kernels.backend(self.kernel_backend):
            return self.model.compute_logits(hidden)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's last norm over these hidden states (what the LM head reads; HF's last_hidden_state)."""
        with kernels.backend(self.kernel_backend):
            return self.model.final_norm(hidden)

    def _forward(self, ids, positions, slots, block_tables, seq_lens, query_start_loc, max_query_len=1, state=None):
        """The model over one step's device tensors (what a graph captures): hidden [T, hidden]. state: a hybrid's
        state slot per sequence."""
        meta = TritonAttnMetadata(slots, block_tables, seq_lens, query_start_loc, max_query_len)
        hybrid = {} if state is None else {"state": self.state.view(query_start_loc, state)}
        with kernels.backend(self.kernel_backend):
            return self.model(ids, positions, self.kv_caches, self.attn, meta, None, **hybrid)

    def warm_shapes(self) -> list[tuple]:
        """(tokens, tokens per sequence, block-table width[, LoRA]) of the padding-only steps that compile every
        Triton variant a step can ask for: tokens 1, 3 and 16 (Triton's int value classes: == 1, other, % 16 == 0),
        decode and full query tiles, and a narrow and a full-width table (the split count: 1, or more on a GPU); and
        one step of a chunk longer than PREFILL_TILE_MIN_QUERY (kernels/prefill_attention.py: one variant per model).
        A mixture of experts also warms its prefill-sized blocks (kernels/fused_moe.py's 64-row blocks, which start at
        LARGE_RUN slots per expert). With LoRA on, steps through slot 0 at 1, 17 and 64 tokens: the LoRA kernel's
        token tile follows the step's token count (16, 32, 64 rows), one variant each for its shrink and its expand."""
        if self.block_table is None:
            return []
        widths = (1, self.block_table.max_blocks)
        shapes = [(t, q, w) for q in (1, 4) for t in (1, 3, 16) for w in widths]
        shapes = [(t, q, w) for t, q, w in shapes if -(-t // q) <= self.max_num_seqs]
        shapes.append((PREFILL_TILE_MIN_QUERY + 1, PREFILL_TILE_MIN_QUERY + 1, 1))  # the prefill kernel's one variant
        spec = self.model.spec
        if spec.num_experts:  # the fewest tokens whose (token, expert) slots take the MoE's 64-row blocks
            t = -(-LARGE_RUN * spec.num_experts // spec.num_experts_per_tok)
            shapes.append((t, t, 1))
        return shapes + ([(t, t, 1, True) for t in LORA_WARM_TOKENS] if self.lora is not None else [])

    def warm(self, tokens: int, per_seq: int, width: int, lora: bool = False) -> None:
        """One padding-only step (cache slot -1, context 0: nothing written or read) and its logits: Triton
        compiles (or loads from its cache) what this shape needs, off the request path. lora: every token through
        slot 0 (whatever it holds: the output is dropped)."""
        dev, b = self.device, -(-tokens // per_seq)
        zeros = torch.zeros(tokens, dtype=torch.int64, device=dev)
        qsl = torch.tensor([min(i * per_seq, tokens) for i in range(b + 1)], dtype=torch.int32, device=dev)
        seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        meta = TritonAttnMetadata(zeros - 1, self.block_table.table[:b, :width], seq_lens, qsl, per_seq)
        delta = self.lora.delta(zeros) if lora else None  # int64 slots, as a step's h2d(token_slot) makes them
        with kernels.backend(self.kernel_backend):
            hidden = self.model(zeros, zeros, self.kv_caches, self.attn, meta, delta)
            self.model.compute_logits(hidden)
