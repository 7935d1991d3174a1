"""Greedy token ids equal HF transformers' (fp32, CPU), and logprobs are close by vLLM's rule."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.utils import TINY_ARCHS, check_logprobs_close, hf_greedy

pytestmark = pytest.mark.slow  # the real SmolLM2 and HF transformers, token for token

SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Paged attention stores the key-value cache in fixed-size blocks so that",
    "1, 2, 3, 4, 5,",
    "Translate to French: I love reading books in the garden on sunny afternoons, especially novels about "
    "history and adventure, because they take me to places I have never been and times I never knew.",
    "Q: Why is the sky blue?\nA:",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smol_reference(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    prompts = [tok(p).input_ids for p in SMOL_PROMPTS]
    return prompts, hf_greedy(smollm2_path, prompts, NEW_TOKENS)


SETTINGS = {
    "defaults": {},
    "chunked": {"max_num_batched_tokens": 24},
    "preempting": {"num_kv_blocks": 24, "max_model_len": 256, "max_num_batched_tokens": 64},
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_smollm2_greedy_matches_hf(smollm2_path, smol_reference, setting):
    prompts, ref = smol_reference
    llm = LLM(model=str(smollm2_path), dtype="float32", log_stats_interval=0, **SETTINGS[setting])
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (out, (ref_ids, ref_lp)) in enumerate(zip(outs, ref)):
        got = out.outputs[0]
        assert got.token_ids == ref_ids, f"prompt {i} ({setting}): {got.token_ids} != {ref_ids}"
        check_logprobs_close(got.token_ids, got.logprobs, ref_ids, ref_lp, f"prompt {i}")
    if setting == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    if setting == "chunked":
        assert max(len(p) for p in prompts) > 24  # so some prompt really was split into chunks
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert llm.engine.runner.attn.native.lib is not None  # attention went through the C kernel (kernels/cpu_attention)


def test_smollm2_text(smollm2_path):
    llm = LLM(model=str(smollm2_path), dtype="float32", log_stats_interval=0)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3))
    assert out[0].outputs[0].text.startswith(" Paris.")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_architectures_match_hf(tiny_models, arch):
    path = tiny_models[arch]
    prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(n)] for i, n in enumerate((1, 7, 16, 33, 70))]
    ref = hf_greedy(path, prompts, 24)
    for setting in ({}, {"max_num_batched_tokens": 8, "num_kv_blocks": 14, "max_model_len": 128}):
        llm = LLM(model=str(path), dtype="float32", log_stats_interval=0, **setting)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24, logprobs=5)
        )
        for i, (out, (ref_ids, ref_lp)) in enumerate(zip(outs, ref)):
            got = out.outputs[0]
            assert got.token_ids == ref_ids, f"{arch} {setting} prompt {i}"
            check_logprobs_close(got.token_ids, got.logprobs, ref_ids, ref_lp, f"{arch} prompt {i}")


def test_the_window_matters(tiny_models):
    """Must-fail: the same windowed checkpoint with its window ignored no longer matches HF, so the
    parity above shows the window is applied (in prefill chunks and in decodes alike)."""
    path = tiny_models["mistral-window"]
    prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(n)] for i, n in enumerate((16, 33, 70))]
    ref = hf_greedy(path, prompts, 24)
    llm = LLM(model=str(path), dtype="float32", log_stats_interval=0)
    assert set(llm.engine.spec.layer_windows) == {6}
    llm.engine.runner.attn.windows = ()  # full attention instead
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] != [r[0] for r in ref]
