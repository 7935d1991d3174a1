"""Gemma 2 and 3 (engine/models/gemma.py). Parity with HF transformers is in test_parity.py (tiny random
checkpoints of both, default settings and chunked prefill + preemption); here, the must-fail side: each Gemma
feature the tiny models are built to exercise, turned off or changed, breaks that parity. And the Triton kernels'
path (windows and soft-caps inside the paged-attention kernel) gives HF's tokens too."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.utils import hf_greedy

pytestmark = pytest.mark.slow  # HF transformers parity for Gemma 2 / 3

PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(n)] for i, n in enumerate((7, 16, 33))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=1)


@pytest.fixture(scope="module")
def refs(tiny_models):
    """Per arch: HF's greedy tokens, and the logprob of each prompt's first greedy token (a monotonic transform
    such as the final soft-cap leaves greedy tokens alone: its effect shows in the logprobs)."""
    out = {}
    for arch in ("gemma2", "gemma3"):
        ref = hf_greedy(tiny_models[arch], PROMPTS, 16, top_n=1)
        out[arch] = ([r[0] for r in ref], [r[1][0][r[0][0]] for r in ref])
    return out


def _tokens(llm) -> tuple[list[list[int]], list[float]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]] for o in outs]


def _same(got, ref) -> bool:
    return got[0] == ref[0] and all(abs(a - b) < 1e-3 for a, b in zip(got[1], ref[1]))


def _break_attn_softcap(llm):
    llm.engine.runner.attn.softcap = None


def _break_final_softcap(llm):
    llm.engine.model.spec = llm.engine.model.spec.__class__(**{**llm.engine.model.spec.__dict__, "final_softcap": None})


def _break_windows(llm):
    llm.engine.runner.attn.windows = ()


def _break_local_rope(llm):
    llm.engine.model.local_rotary = None  # the sliding layers use the global rope


@pytest.mark.parametrize(
    "arch,breaker",
    [
        ("gemma2", _break_attn_softcap),
        ("gemma2", _break_final_softcap),
        ("gemma2", _break_windows),
        ("gemma3", _break_windows),
        ("gemma3", _break_local_rope),
    ],
    ids=["gemma2-attn-softcap", "gemma2-final-softcap", "gemma2-window", "gemma3-window", "gemma3-local-rope"],
)
def test_each_feature_matters(tiny_models, refs, arch, breaker):
    llm = LLM(model=str(tiny_models[arch]), dtype="float32", log_stats_interval=0)
    assert _same(_tokens(llm), refs[arch])
    breaker(llm)
    assert not _same(_tokens(llm), refs[arch]), (
        f"{breaker.__name__} left {arch}'s output as HF's: the test could not fail"
    )


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_triton_kernels_match_hf(tiny_models, refs, arch):
    llm = LLM(model=str(tiny_models[arch]), dtype="float32", kernel_backend="triton", log_stats_interval=0)
    assert _same(_tokens(llm), refs[arch])


def test_lora_on_gemma(tiny_models, tmp_path):
    """LoRA works on the new families' projections: a PEFT adapter on Gemma 2 (attention and MLP) gives
    HF + peft's tokens, and differs from the base model's."""
    from engine import LoRARequest
    from tests.lora_fixtures import make_peft_adapter
    from tests.test_lora_engine import lora_llm, peft_greedy

    base = tiny_models["gemma2"]
    folder, _ = make_peft_adapter(base, tmp_path / "ad", r=4, alpha=8, seed=3, b_std=0.3)
    ref = peft_greedy(base, folder, PROMPTS)
    assert ref != peft_greedy(base, None, PROMPTS), "the adapter must change the output, or this could not fail"
    llm = lora_llm(base, {"ad": folder}, tmp_path, max_lora_rank=4)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, lora=LoRARequest("ad"))
    assert [o.outputs[0].token_ids for o in outs] == ref
