"""Turns a SchedulerOutput into one flat varlen batch, runs the model, samples. The only place that
builds tensors."""

from __future__ import annotations

import torch

import kernels
from engine.layers.attention import StepLayout
from engine.sampler import Sampler
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
    ):
        self.model = model
        self.kernel_backend = kernel_backend
        self.kv_caches = kv_caches
        self.attn = attn
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(model.spec.vocab_size, device)
        self.lora = lora  # the engine's LoRAManager when LoRA is enabled

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[dict[Request, int], dict[Request, dict]]:
        """Run one step. Returns the sampled token of each request whose prefill is complete, and
        top-N logprobs for those that asked."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        token_slot: list[int] = []  # per token: its adapter's device slot, -1 = none
        for req, n in zip(out.requests, out.num_scheduled_tokens):
            if self.lora is not None:
                token_slot += [req.lora_slot if req.lora_key is not None else -1] * n
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            input_ids += req.token_slice(start, end)
            positions += range(start, end)
            table = req.block_ids
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            if end == req.num_tokens:  # the chunk reaches the last token: this row samples
                sample_rows.append(qsl[-1] - 1)
                sample_reqs.append(req)

        dev = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)  # [T]
        pos_t = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)  # [T]
        layout = StepLayout(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=[r.block_ids for r in out.requests],
        )
        meta = self.attn.build(layout, dev)
        lora = None
        if any(s >= 0 for s in token_slot):  # a step without adapters pays nothing for LoRA
            lora = self.lora.delta(torch.tensor(token_slot, dtype=torch.int64).to(dev, non_blocking=True))
        with kernels.backend(self.kernel_backend):
            hidden = self.model(ids_t, pos_t, self.kv_caches, self.attn, meta, lora)  # [T, hidden]
            if not sample_reqs:
                return {}, {}
            logits = self.model.compute_logits(hidden[sample_rows])  # [S, vocab] fp32
        tokens, logprobs = self.sampler(logits, sample_reqs)
        sampled = dict(zip(sample_reqs, tokens))
        lps = {r: lp for r, lp in zip(sample_reqs, logprobs) if lp is not None}
        return sampled, lps
