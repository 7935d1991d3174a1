"""Prompt logprobs (engine/step_runner.py): computed in slices the activation reserve holds, and the same whether a
step ran eagerly or replayed a CUDA graph (a one-token prefill chunk fits a decode bucket)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.test_cuda_graphs import ENGINE, PROMPTS, ReplayGraph

PROMPT = list(range(3, 60))


def _close(a: list, b: list, tol: float) -> None:
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= tol for t in x)


def test_prompt_logprobs_in_slices_equal_one_pass(tiny_llama, monkeypatch):
    """A 57-token prompt in one chunk with max_num_seqs=5: the LM head runs over at most 5 rows at a time (the
    rows the memory planner's reserve counts), and the logprobs equal those of one pass over every row."""
    kw = dict(dtype="float32", log_stats_interval=0, max_num_batched_tokens=64, num_kv_blocks=32)
    sp = SamplingParams(max_tokens=1, prompt_logprobs=3)
    whole = LLM(str(tiny_llama), max_num_seqs=64, **kw).generate({"prompt_token_ids": PROMPT}, sp)[0]
    llm = LLM(str(tiny_llama), max_num_seqs=5, **kw)
    runner, rows = llm.engine.step_runner.runner, []

    def logits(hidden, r, _real=runner.logits):
        rows.append(hidden.shape[0] if r is None else len(r))
        return _real(hidden, r)

    monkeypatch.setattr(runner, "logits", logits)
    sliced = llm.generate({"prompt_token_ids": PROMPT}, sp)[0]
    assert max(rows) == 5 and sum(rows) == len(PROMPT) - 1 + 1  # every predicting row once, then the sampled one
    assert len(sliced.prompt_logprobs) == len(PROMPT)
    _close(sliced.prompt_logprobs, whole.prompt_logprobs, 1e-5)


@pytest.mark.slow  # Triton kernels under the interpreter
def test_one_token_prefill_chunks_replayed_from_a_graph_keep_prompt_logprobs(tiny_llama):
    """A budget of 2 tokens over 2 sequences: once the first decodes, the second's prompt goes one token per step,
    and each such step ([1, 1] tokens) replays the bucket-2 graph. Its prompt logprobs are computed from the
    replayed hidden states: the same list as the eager engine's, none skipped or shifted."""
    kw = {**ENGINE, "max_num_seqs": 2, "max_num_batched_tokens": 2}
    prompts = [{"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": PROMPTS[2]}]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    ref = LLM(str(tiny_llama), **kw).generate(prompts, sp)
    llm = LLM(str(tiny_llama), **kw)
    graphs = llm.engine.runner.enable_graphs(ReplayGraph)
    step_runner, replayed_prefills = llm.engine.step_runner, []
    real = step_runner.execute

    def execute(step, *faults):
        before = graphs.replays
        predicting = [
            r
            for r, n in zip(step.scheduled.requests, step.scheduled.num_scheduled_tokens)
            if n == 1 and r.num_computed_tokens <= r.num_prompt_tokens - 2  # its row predicts a prompt token
        ]
        out = real(step, *faults)
        if graphs.replays > before:
            replayed_prefills.extend(predicting)
        return out

    step_runner.execute = execute
    out = llm.generate(prompts, sp)
    assert len(replayed_prefills) >= 5, ReplayGraph.errors
    for o, r in zip(out, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert len(o.prompt_logprobs) == len(r.prompt_logprobs) == len(o.prompt_token_ids)
        _close(o.prompt_logprobs, r.prompt_logprobs, 1e-4)
