"""Turns a SchedulerOutput into one flat varlen batch, runs the model, samples. The only place that
builds tensors."""

from __future__ import annotations

import torch

import kernels
from engine.block_table import DeviceBlockTable, h2d, h2d_rows
from engine.cuda_graphs import DecodeGraphs
from engine.layers.attention import StepLayout, TritonAttnMetadata
from engine.sampler import Sampler
from engine.spec_decode.rejection import verify
from engine.types import Request, SchedulerOutput


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
        vocab_size: int | None = None,
    ):
        self.model = model
        self.kernel_backend = kernel_backend
        self.kv_caches = kv_caches
        self.attn = attn
        self.block_size = block_size
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.sampler = Sampler(vocab_size or model.spec.vocab_size, device)
        self.lora = lora  # the engine's LoRAManager when LoRA is enabled
        # Triton attention reads block tables from a persistent device tensor; the torch backend plans on the host
        self.block_table = (
            DeviceBlockTable(max_num_seqs, -(-max_model_len // block_size), device)
            if kernel_backend == "triton"
            else None
        )
        self.graphs: DecodeGraphs | None = None
        self.structured = None  # the engine's StructuredOutputs, once a constrained request has come
        self.tp = None  # rank 0's TPGroup under tensor parallelism: each forward and LM head is replayed there

    def enable_graphs(self, new_graph) -> DecodeGraphs:
        """Decode steps may replay CUDA graphs once their buckets are captured (engine/cuda_graphs.py)."""
        if self.block_table is None:
            raise ValueError("CUDA graphs need the Triton attention backend")
        self.graphs = DecodeGraphs(self._forward, self.block_table, self.max_num_seqs, self.device, new_graph)
        return self.graphs

    def _forward(self, ids, positions, slots, block_tables, seq_lens, query_start_loc, max_query_len=1):
        """The model over one step's device tensors (a decode step is what a graph captures): hidden [T, hidden]."""
        meta = TritonAttnMetadata(slots, block_tables, seq_lens, query_start_loc, max_query_len)
        with kernels.backend(self.kernel_backend):
            return self.model(ids, positions, self.kv_caches, self.attn, meta, None)

    def warm_shapes(self) -> list[tuple[int, int, int]]:
        """(tokens, tokens per sequence, block-table width) of the padding-only steps that compile every Triton
        variant a step can ask for: tokens 1, 3 and 16 (Triton's int value classes: == 1, other, % 16 == 0), decode
        and full query tiles, and a narrow and a full-width table (the split count: 1, or more on a GPU)."""
        if self.block_table is None:
            return []
        widths = (1, self.block_table.max_blocks)
        shapes = [(t, q, w) for q in (1, 4) for t in (1, 3, 16) for w in widths]
        return [(t, q, w) for t, q, w in shapes if -(-t // q) <= self.max_num_seqs]

    def warm(self, tokens: int, per_seq: int, width: int) -> None:
        """One padding-only step (cache slot -1, context 0: nothing written or read) and its logits: Triton
        compiles (or loads from its cache) what this shape needs, off the request path."""
        dev, b = self.device, -(-tokens // per_seq)
        zeros = torch.zeros(tokens, dtype=torch.int64, device=dev)
        qsl = torch.tensor([min(i * per_seq, tokens) for i in range(b + 1)], dtype=torch.int32, device=dev)
        seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        bt = self.block_table.table[:b, :width]
        hidden = self._forward(zeros, zeros, zeros - 1, bt, seq_lens, qsl, max_query_len=per_seq)
        with kernels.backend(self.kernel_backend):
            self.model.compute_logits(hidden)

    def _flat(self, items) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """items: (request, first position, its token ids) per sequence -> the flat batch's input ids, positions,
        cache slots (from the request's block table), query_start_loc and seq_lens."""
        bs = self.block_size
        input_ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for req, start, ids in items:
            end = start + len(ids)
            input_ids += ids
            positions += range(start, end)
            table = req.block_ids
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            qsl.append(qsl[-1] + len(ids))
            seq_lens.append(end)
        return input_ids, positions, slots, qsl, seq_lens

    @torch.inference_mode()
    def forward(self, items) -> tuple[torch.Tensor, list[int]]:
        """The model (eager, no adapters) over one flat batch of `items` (see _flat): hidden [T, hidden] and
        query_start_loc. The draft model's runs."""
        input_ids, positions, slots, qsl, seq_lens = self._flat(items)
        tables = [r.block_ids for r, _, _ in items]
        bt = self.block_table.update(tables) if self.block_table is not None else None
        return self._eager(input_ids, positions, slots, qsl, seq_lens, tables, bt, [], False), qsl

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[dict[Request, list[int]], dict[Request, list[dict]]]:
        """Run one step. Returns the tokens of each request whose prefill is complete (one, or with speculation
        the accepted drafts and the target's next token), and their top-N logprobs for those that asked."""
        items, sample_reqs, sample_rows, drafts = [], [], [], []
        end_row = 0
        for req, n in zip(out.requests, out.num_scheduled_tokens):
            spec = out.spec_tokens.get(req, [])
            start, real = req.num_computed_tokens, n - len(spec)
            items.append((req, start, req.token_slice(start, start + real) + spec))
            end_row += n
            if start + real == req.num_tokens:  # the chunk reaches the last token: this row samples, and each draft
                sample_rows += range(end_row - 1 - len(spec), end_row)
                sample_reqs.append(req)
                drafts.append(spec)
        input_ids, positions, slots, qsl, seq_lens = self._flat(items)
        token_slot = []  # per token: its adapter's device slot, -1 = none
        if self.lora is not None:
            for req, n in zip(out.requests, out.num_scheduled_tokens):
                token_slot += [req.lora_slot if req.lora_key is not None else -1] * n
        uses_lora = any(s >= 0 for s in token_slot)
        tables = [r.block_ids for r in out.requests]
        bt = self.block_table.update(tables) if self.block_table is not None else None
        bucket = self.graphs.bucket(out.num_scheduled_tokens, uses_lora) if self.graphs is not None else None
        if bucket is not None:
            hidden = self.graphs.run(bucket, input_ids, positions, slots, seq_lens)  # [n, hidden]
        else:
            hidden = self._eager(input_ids, positions, slots, qsl, seq_lens, tables, bt, token_slot, uses_lora)
            if any(r.params.prompt_logprobs is not None for r in out.requests):
                self._prompt_logprobs(hidden, out, qsl)
        if not sample_reqs:
            return {}, {}
        # grammar masks are filled on the host while a GPU still runs the forward pass launched above
        mask = self.structured.fill(sample_reqs, drafts) if self.structured is not None else None
        logits = self.logits(hidden, sample_rows)  # [S, vocab] fp32
        if mask is not None:
            self.structured.apply(logits, mask)
        if out.spec_tokens:
            tokens, logprobs = verify(self.sampler, logits, sample_reqs, drafts, out.draft_probs)
        else:
            tokens, logprobs = self.sampler(logits, sample_reqs)
            tokens = [[t] for t in tokens]
            logprobs = [[lp] if lp is not None else None for lp in logprobs]
        sampled = dict(zip(sample_reqs, tokens))
        lps = {r: lp for r, lp in zip(sample_reqs, logprobs) if lp is not None}
        return sampled, lps

    def _prompt_logprobs(self, hidden: torch.Tensor, out: SchedulerOutput, qsl: list[int]) -> None:
        """For each request that asked: the logprobs of the prompt tokens this chunk predicts (row j of a chunk
        starting at position s predicts token s + j + 1), appended to req.prompt_logprobs. Positions already
        there (a preempted request's recomputed prefill) are not done twice."""
        for i, (req, n) in enumerate(zip(out.requests, out.num_scheduled_tokens)):
            top = req.params.prompt_logprobs
            if top is None:
                continue
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]  # nothing predicts the first token
            start = req.num_computed_tokens
            first, last = max(start + 1, len(req.prompt_logprobs)), min(start + n, req.num_prompt_tokens - 1)
            if first > last:
                continue
            rows = [qsl[i] + q - 1 - start for q in range(first, last + 1)]
            targets = req.prompt_token_ids[first : last + 1]
            lp = torch.log_softmax(self.logits(hidden, rows), dim=-1)  # [P, vocab] fp32
            chosen = lp.gather(1, h2d([[t] for t in targets], torch.int64, lp.device))
            v, idx = lp.topk(top, dim=-1) if top else (lp[:, :0], lp[:, :0])
            host = torch.cat([chosen, v, idx.to(lp.dtype)], 1).cpu().tolist()  # one copy to the host
            for t, row in zip(targets, host):
                d = dict(zip(map(int, row[1 + top :]), row[1 : 1 + top]))
                d.setdefault(t, row[0])
                req.prompt_logprobs.append(d)

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The LM head over these rows of a step's hidden states: [len(rows), vocab] fp32 (under tensor
        parallelism every rank runs its part, and rank 0 gets them all)."""
        every = len(rows) == hidden.shape[0]  # the rows are all of them, in order
        if self.tp is not None:
            self.tp.send(("logits", None if every else rows))
        return self.logits_local(hidden if every else hidden[h2d(rows, torch.int64, hidden.device)])

    def logits_local(self, x: torch.Tensor) -> torch.Tensor:
        with kernels.backend(self.kernel_backend):
            return self.model.compute_logits(x)

    def replay(self, step: tuple) -> torch.Tensor:
        """Another tensor-parallel rank: the forward pass rank 0's `_eager` described (worker.py)."""
        input_ids, positions, slots, qsl, seq_lens, tables, token_slot, uses_lora = step
        bt = self.block_table.update(tables) if self.block_table is not None else None
        return self._eager(input_ids, positions, slots, qsl, seq_lens, tables, bt, token_slot, uses_lora)

    def _eager(self, input_ids, positions, slots, qsl, seq_lens, tables, bt, token_slot, uses_lora) -> torch.Tensor:
        if self.tp is not None:  # the other ranks run the same step, from its host-side description
            self.tp.send(("forward", (input_ids, positions, slots, qsl, seq_lens, tables, token_slot, uses_lora)))
        dev = self.device
        ids_t, pos_t, slots_t = h2d_rows([input_ids, positions, slots], torch.int64, dev)  # one copy
        layout = StepLayout(
            slot_mapping=slots_t,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables,
            block_table=bt,
        )
        meta = self.attn.build(layout, dev)
        lora = None
        if uses_lora:  # a step without adapters pays nothing for LoRA
            lora = self.lora.delta(h2d(token_slot, torch.int64, dev))
        with kernels.backend(self.kernel_backend):
            return self.model(ids_t, pos_t, self.kv_caches, self.attn, meta, lora)  # [T, hidden]
