"""Mixture of experts (engine/models/moe.py). Parity with HF transformers for Mixtral, Qwen2-MoE and
Qwen3-MoE is in test_parity.py (default settings and chunked prefill + preemption); here: routing spreads over the
experts, and each MoE feature changed (expert order, the shared expert, top-k renormalization) breaks that parity;
the Triton kernels' path gives HF's tokens; fp8 experts load with per-expert scales (their bytes counted by the
planner); LoRA on an expert MLP is refused, on attention it works."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, InvalidRequestError, LoRARequest, SamplingParams, memory
from tests.utils import hf_greedy

pytestmark = pytest.mark.slow  # HF transformers parity and the fused-MoE kernel under the Triton interpreter

PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(n)] for i, n in enumerate((7, 16, 33))]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
ARCHS = ("mixtral", "qwen2-moe", "qwen3-moe")


@pytest.fixture(scope="module")
def refs(tiny_models):
    return {a: [r[0] for r in hf_greedy(tiny_models[a], PROMPTS, 16)] for a in ARCHS}


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def test_routing_spreads_over_experts(tiny_models, monkeypatch):
    import kernels.fused_moe as fm

    llm = LLM(model=str(tiny_models["mixtral"]), dtype="float32", log_stats_interval=0)
    seen, real = set(), fm.fused_moe_ref
    monkeypatch.setattr(fm, "fused_moe_ref", lambda *a, **k: seen.update(a[4].flatten().tolist()) or real(*a, **k))
    _tokens(llm)
    assert seen == set(range(llm.engine.spec.num_experts)), seen  # every expert receives tokens


def _swap_experts(llm):
    for layer in llm.engine.model.layers:
        if layer.moe:
            layer.w13.data = layer.w13.data.flip(0)  # expert j gets expert E-1-j's weights


def _drop_shared(llm):
    for layer in llm.engine.model.layers:
        layer.shared_gate_up = None


def _flip_norm(llm):
    spec = llm.engine.model.spec
    llm.engine.model.spec = spec.__class__(**{**spec.__dict__, "norm_topk_prob": not spec.norm_topk_prob})


@pytest.mark.parametrize(
    "arch,breaker",
    [("mixtral", _swap_experts), ("qwen2-moe", _drop_shared), ("qwen3-moe", _flip_norm), ("mixtral", _flip_norm)],
    ids=["mixtral-expert-order", "qwen2moe-shared-expert", "qwen3moe-renormalize", "mixtral-renormalize"],
)
def test_each_feature_matters(tiny_models, refs, arch, breaker):
    llm = LLM(model=str(tiny_models[arch]), dtype="float32", log_stats_interval=0)
    assert _tokens(llm) == refs[arch]
    breaker(llm)
    assert _tokens(llm) != refs[arch], f"{breaker.__name__} left {arch}'s output as HF's: the test could not fail"


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe"])
def test_triton_kernels_match_hf(tiny_models, refs, arch):
    llm = LLM(model=str(tiny_models[arch]), dtype="float32", kernel_backend="triton", log_stats_interval=0)
    assert _tokens(llm) == refs[arch]


def test_triton_prefill_sized_blocks_match_hf(tiny_models, refs, monkeypatch):
    """Every step through the 64-row blocks the kernel takes for prefill-sized steps (a tiny model's steps are too
    short to reach them, so the threshold is lowered to 0): still HF's tokens."""
    from kernels import fused_moe

    monkeypatch.setattr(fused_moe, "LARGE_RUN", 0)
    seen, real = [], fused_moe.moe_align
    monkeypatch.setattr(fused_moe, "moe_align", lambda ids, e, block: seen.append(block) or real(ids, e, block))
    llm = LLM(model=str(tiny_models["mixtral"]), dtype="float32", kernel_backend="triton", log_stats_interval=0)
    assert _tokens(llm) == refs["mixtral"]
    assert seen and set(seen) == {fused_moe.BLOCK_M_LARGE}


def test_fp8_experts(tiny_models, tmp_path):
    path = tiny_models["qwen3-moe"]
    kw = dict(model=str(path), dtype="bfloat16", log_stats_interval=0, cache_root=str(tmp_path))
    base, fp8 = LLM(**kw), LLM(quantization="fp8", **kw)
    want = _tokens(fp8)  # on an empty prefix cache, as the snapshot's engine below
    layer = fp8.engine.model.layers[0]
    assert layer.w13.dtype == torch.float8_e4m3fn and layer.expert_scales["w13"].shape == (*layer.w13.shape[:2], 1)
    bytes_of = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    got = bytes_of(fp8.engine.model) + sum(
        s.numel() * 4
        for lyr in fp8.engine.model.layers
        for s in (*lyr.fp8_scales.values(), *lyr.expert_scales.values())
    )
    assert got == memory.weight_bytes(fp8.engine.spec, 2, "fp8")  # the planner counts every expert
    assert bytes_of(base.engine.model) == memory.weight_bytes(base.engine.spec, 2, None)
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    ours, ref = (x.generate([{"prompt_token_ids": p} for p in PROMPTS], first) for x in (fp8, base))
    for a, b in zip(ours, ref):  # vLLM's closeness rule on the first token: each side's choice in the other's top 5
        ta, tb = a.outputs[0].token_ids[0], b.outputs[0].token_ids[0]
        assert tb in a.outputs[0].logprobs[0] and ta in b.outputs[0].logprobs[0]
    again = LLM(quantization="fp8", **kw)  # from the fp8 snapshot: expert scales included
    assert again.engine.weights_source == "fp8 snapshot" and _tokens(again) == want


def test_lora_on_attention_works_and_on_experts_is_refused(tiny_models, tmp_path):
    from tests.lora_fixtures import make_peft_adapter
    from tests.test_lora_engine import lora_llm, peft_greedy

    base = tiny_models["qwen3-moe"]
    attn, _ = make_peft_adapter(
        base, tmp_path / "attn", r=4, alpha=8, seed=2, b_std=0.3, targets=("q_proj", "v_proj", "o_proj")
    )
    experts = tmp_path / "experts"
    experts.mkdir()
    cfg = json.loads((attn / "adapter_config.json").read_text()) | {"target_modules": ["gate_proj"]}
    (experts / "adapter_config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file

    save_file(
        {
            "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_B.weight": torch.zeros(64, 4),
        },
        str(experts / "adapter_model.safetensors"),
    )
    llm = lora_llm(base, {"attn": attn, "experts": experts}, tmp_path, max_lora_rank=4)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, lora=LoRARequest("attn"))
    assert [o.outputs[0].token_ids for o in outs] == peft_greedy(base, attn, PROMPTS)
    with pytest.raises(InvalidRequestError, match="expert"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, sp, lora=LoRARequest("experts"))


def test_decode_graphs_on_moe(tiny_models, refs):
    """The MoE layer inside a decode graph gives HF's tokens. The CPU stand-in (tests/graph_standin.py) replays the
    captured function over the static buffers; its routing and alignment make no host sync it can see (no .item(),
    .tolist(), nonzero, unique, boolean mask, ...), and every replay runs the capture's ops on the same buffers."""
    from tests.graph_standin import SyncCheckedGraph

    llm = LLM(model=str(tiny_models["mixtral"]), dtype="float32", kernel_backend="triton", log_stats_interval=0)
    graphs = llm.engine.runner.enable_graphs(SyncCheckedGraph)
    assert _tokens(llm) == refs["mixtral"]
    assert graphs.captured and graphs.replays > 0, SyncCheckedGraph.errors


def test_warm_steps_reach_the_prefill_sized_expert_blocks(tiny_models):
    """The warm steps after ready include one whose (token, expert) slots take the fused MoE's 64-row blocks, so a
    long prompt's first step compiles no new MoE variant."""
    from kernels.fused_moe import BLOCK_M_LARGE, block_size_for

    llm = LLM(model=str(tiny_models["mixtral"]), dtype="float32", kernel_backend="triton", log_stats_interval=0)
    spec = llm.engine.spec
    blocks = {
        block_size_for(s[0] * spec.num_experts_per_tok, spec.num_experts) for s in llm.engine.runner.warm_shapes()
    }
    assert BLOCK_M_LARGE in blocks and len(blocks) == 2, blocks
    llm.engine.runner.warm(*llm.engine.runner.warm_shapes()[-1][:3])  # the step itself runs
