"""One engine step on rank 0: a StepInput -> one flat varlen batch -> the model (ModelRunner, or TPRunner under
tensor parallelism) -> the LM head over the rows that sample -> grammar masks -> the sampler, or rejection sampling
over each speculating sequence's k + 1 rows -> the tokens each sequence emits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import faults as faults_
from engine import pooling
from engine.block_table import h2d
from engine.errors import EngineFault
from engine.model_runner import FlatBatch, flat_batch
from engine.sampler import Sampler
from engine.spec_decode.rejection import verify
from engine.spec_decode.speculator import Drafts
from engine.structured import GrammarMasks
from engine.types import Request, SchedulerOutput, StepOutput


@dataclass(frozen=True)
class StepInput:
    """What one step runs: the scheduler's plan and what the engine added to it."""

    scheduled: SchedulerOutput
    drafts: Drafts  # the tokens that fill each speculating request's granted lookahead slots, and their q rows
    grammar: GrammarMasks  # token bitmasks of the constrained sampling rows (filled when applied to the logits)


EMPTY = StepOutput({}, {})


class StepRunner:
    def __init__(self, runner, sampler: Sampler, max_rows: int | None = None):
        """runner: rank 0's ModelRunner, or the TPRunner that sends each call to the other ranks first. max_rows: the
        most logits rows one prompt-logprobs slice takes; by default max_num_seqs (rank 0's runner's), the rows the
        memory planner's activation reserve counts (a chunk's prompt can be max_num_batched_tokens rows)."""
        self.runner = runner
        self.sampler = sampler
        self.block_size = runner.block_size
        self.rank0 = getattr(runner, "runner", runner)  # rank 0's own ModelRunner (the TPRunner wraps it)
        self.max_rows = max_rows or self.rank0.max_num_seqs

    @torch.inference_mode()
    def execute(self, step: StepInput, faults: frozenset[str] = frozenset()) -> StepOutput:
        """faults: FAULT_INJECTION's for this step (engine/faults.py): "oom" raises the device's out-of-memory error
        after the forward pass, "nan" makes row 0 of the logits NaN."""
        out, drafts = step.scheduled, step.drafts.tokens
        if out.empty:
            return EMPTY
        batch, rows = self._batch(out, drafts)
        hidden = self.runner.forward(batch)  # [T, hidden]; on a GPU it runs on while the host goes on below
        if "oom" in faults:
            raise faults_.injected_oom()
        self._prompt_logprobs(hidden, out, batch.query_start_loc)
        self._pool(hidden, out, batch.query_start_loc)
        if not rows:  # only prefill chunks that do not reach their prompt's end
            return EMPTY
        logits = self.runner.logits(hidden, rows)  # [S, vocab] fp32
        if "nan" in faults:
            logits[0] = float("nan")
        step.grammar.apply(logits)  # the masks are filled on the host now, while a GPU still runs the above
        reqs = out.sampling
        if drafts:
            tokens, logprobs = verify(self.sampler, logits, reqs, [drafts.get(r, []) for r in reqs], step.drafts.probs)
        else:
            tokens, logprobs = self.sampler(logits, reqs)
            tokens = [[t] for t in tokens]
            logprobs = [[lp] if lp is not None else None for lp in logprobs]
        # a row whose logits had a NaN or +inf sampled -1 (Sampler.screen): its request fails, the others go on
        failed = {r: faults_.nan_logits() for r, ts in zip(reqs, tokens) if ts[-1] < 0}
        if len(failed) == len(reqs) > 1:  # one row alone may be its request's own; every row of many is the device
            raise EngineFault(f"every row of the step's logits ({len(reqs)}) was NaN or infinite: a device fault")
        return StepOutput(
            {r: ts for r, ts in zip(reqs, tokens) if r not in failed},
            {r: lp for r, lp in zip(reqs, logprobs) if lp is not None and r not in failed},
            failed,
        )

    def _batch(self, out: SchedulerOutput, drafts: dict[Request, list[int]]) -> tuple[FlatBatch, list[int]]:
        """Each request's scheduled tokens (a prefill chunk, or its last token then its drafts) as one flat batch,
        and the rows that sample: each sampling request's last row, after one row per draft."""
        items, rows, end = [], [], 0
        sampling = set(out.sampling)
        for req, n in zip(out.requests, out.num_scheduled_tokens):
            ds = drafts.get(req, [])
            start = req.num_computed_tokens
            items.append((req, start, req.token_slice(start, start + n - len(ds)) + ds))
            end += n
            if req in sampling:
                rows += range(end - 1 - len(ds), end)
        return flat_batch(items, self.block_size, _token_slots(out)), rows

    def _prompt_logprobs(self, hidden: torch.Tensor, out: SchedulerOutput, qsl: list[int]) -> None:
        """For each request that asked: the logprobs of the prompt tokens this chunk predicts (row j of a chunk
        starting at position s predicts token s + j + 1), appended to req.prompt_logprobs. Positions already
        there (a preempted request's recomputed prefill) are not done twice. The LM head and log_softmax run over
        at most max_rows rows at a time, so their fp32 copies stay within the activation reserve."""
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
            parts = []
            for a in range(0, len(rows), self.max_rows):
                lp = torch.log_softmax(self.runner.logits(hidden, rows[a : a + self.max_rows]), dim=-1)  # fp32
                ts = [[t] for t in targets[a : a + self.max_rows]]
                chosen = lp.gather(1, h2d(ts, torch.int64, lp.device))
                v, idx = lp.topk(top, dim=-1) if top else (lp[:, :0], lp[:, :0])
                parts.append(torch.cat([chosen, v, idx.to(lp.dtype)], 1))
            host = torch.cat(parts).cpu().tolist()  # one copy to the host
            for t, row in zip(targets, host):
                d = dict(zip(map(int, row[1 + top :]), row[1 : 1 + top]))
                d.setdefault(t, row[0])
                req.prompt_logprobs.append(d)

    def _pool(self, hidden: torch.Tensor, out: SchedulerOutput, qsl: list[int]) -> None:
        """Embedding requests (params.pooling): this chunk's final hidden states, normed as HF's last_hidden_state,
        pooled into the request (engine/pooling.py). Only rank 0 runs this: its hidden states are whole."""
        for i, (req, n) in enumerate(zip(out.requests, out.num_scheduled_tokens)):
            if req.params.pooling is not None:
                normed = self.rank0.final_norm(hidden[qsl[i] : qsl[i] + n])
                pooling.pool_chunk(req, normed, req.num_computed_tokens, n)


def _token_slots(out: SchedulerOutput) -> list[int] | tuple[()]:
    """Each token's LoRA slot (-1: the base model) when a request of the step has an adapter; () when none has."""
    if all(r.lora_key is None for r in out.requests):
        return ()
    slots = []
    for req, n in zip(out.requests, out.num_scheduled_tokens):
        slots += [req.lora_slot if req.lora_key is not None else -1] * n
    return slots
