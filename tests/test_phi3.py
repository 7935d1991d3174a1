"""Phi-3 (fused qkv_proj / gate_up_proj checkpoints, longrope). Parity with HF is in test_parity.py; here:
the short factors matter (turned off, parity breaks), the long factors' tables equal transformers' from the
original length on, and a PEFT adapter on Phi-3's fused projections matches HF + peft."""

from __future__ import annotations

import json

import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.layers.rotary import RotaryCache
from tests.utils import hf_greedy

PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(n)] for i, n in enumerate((7, 16, 33))]


def test_short_factors_matter(tiny_models):
    path = tiny_models["phi3"]
    ref = [r[0] for r in hf_greedy(path, PROMPTS, 16)]
    llm = LLM(model=str(path), dtype="float32", log_stats_interval=0)
    sp = SamplingParams(temperature=0, max_tokens=16)
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)] == ref
    spec = llm.engine.spec
    llm.engine.model.rotary = RotaryCache(spec.head_dim, 512, spec.rope_theta, None, "cpu")  # plain rope
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)]
    assert got != ref


def test_long_factors_from_the_original_length_on(tiny_models):
    """From original_max_position_embeddings on, the tables are transformers' long-factor ones (its rotary module
    for a sequence longer than that); below it, its short-factor ones."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    path = tiny_models["phi3"]
    cfg = AutoConfig.from_pretrained(str(path))
    ours = LLM(model=str(path), dtype="float32", log_stats_interval=0, max_model_len=400).engine.model.rotary
    hf = Phi3RotaryEmbedding(cfg)
    x = torch.zeros(1, 1, 16)
    orig = json.loads((path / "config.json").read_text())["original_max_position_embeddings"]
    for positions in (torch.arange(0, orig)[None], torch.arange(0, 300)[None]):
        cos, sin = hf(x, positions)
        sel = positions[0] >= orig if positions.shape[1] > orig else positions[0] < orig
        torch.testing.assert_close(ours.cos[positions[0][sel]], cos[0][sel])
        torch.testing.assert_close(ours.sin[positions[0][sel]], sin[0][sel])


def test_lora_on_fused_projections(tiny_models, tmp_path):
    from tests.lora_fixtures import make_peft_adapter
    from tests.test_lora_engine import lora_llm, peft_greedy

    base = tiny_models["phi3"]
    folder, _ = make_peft_adapter(
        base, tmp_path / "ad", r=4, alpha=8, seed=5, b_std=0.3, targets=("qkv_proj", "o_proj", "gate_up_proj")
    )
    ref = peft_greedy(base, folder, PROMPTS)
    assert ref != peft_greedy(base, None, PROMPTS)
    llm = lora_llm(base, {"ad": folder}, tmp_path, max_lora_rank=4)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, lora=LoRARequest("ad"))
    assert [o.outputs[0].token_ids for o in outs] == ref
