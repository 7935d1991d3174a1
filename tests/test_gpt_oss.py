"""GPT-OSS (engine/models/gpt_oss.py). Parity with HF transformers on a tiny random config (sinks, biases, sliding
and full layers, YaRN, clamped SwiGLU experts) under default settings and chunked prefill with preemption is in
test_parity.py (TINY_ARCHS); here: each GPT-OSS feature changed breaks that parity (sinks, expert biases, the
SwiGLU clamp), routing reaches every expert, prefix caching and the C decode kernel keep HF's tokens, MXFP4 experts
dequantize exactly as transformers does and load into a model that gives HF's tokens, and fp8 experts load (from an
fp8 snapshot too)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.models.gpt_oss import dequantize_mxfp4
from tests.utils import hf_greedy

pytestmark = pytest.mark.slow  # HF transformers parity

PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(n)] for i, n in enumerate((7, 16, 33))]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["gpt-oss"]


@pytest.fixture(scope="module")
def ref(model):
    return [r[0] for r in hf_greedy(model, PROMPTS, 16)]


def _tokens(llm, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def _zero_sinks(llm):
    for layer in llm.engine.model.layers:
        layer.sinks.data.fill_(float("-inf"))  # exp(-inf) = 0: attention as if it had none


def _zero_expert_biases(llm):
    for layer in llm.engine.model.layers:
        layer.w13_bias.data.zero_()
        layer.w2_bias.data.zero_()


def _no_clamp(llm):
    spec = llm.engine.model.spec
    llm.engine.model.spec = spec.__class__(**{**spec.__dict__, "swiglu": (spec.swiglu[0], 1e9)})


@pytest.mark.parametrize("breaker", [_zero_sinks, _zero_expert_biases, _no_clamp], ids=lambda f: f.__name__[1:])
def test_each_feature_matters(model, ref, breaker):
    llm = LLM(model=str(model), dtype="float32", log_stats_interval=0)
    assert llm.engine.spec.attention_sinks and llm.engine.spec.swiglu == (1.702, 0.4)
    assert _tokens(llm) == ref
    breaker(llm)
    assert _tokens(llm) != ref, f"{breaker.__name__} left the output as HF's: the test could not fail"


def test_routing_reaches_every_expert(model, monkeypatch):
    import kernels.fused_moe as fm

    llm = LLM(model=str(model), dtype="float32", log_stats_interval=0)
    seen, real = set(), fm.fused_moe_ref
    monkeypatch.setattr(fm, "fused_moe_ref", lambda *a, **k: seen.update(a[4].flatten().tolist()) or real(*a, **k))
    _tokens(llm)
    assert seen == set(range(llm.engine.spec.num_experts)), seen


def test_prefix_cache_and_the_c_kernel_keep_hf_tokens(model, ref):
    llm = LLM(model=str(model), dtype="float32", log_stats_interval=0, block_size=8)
    native = llm.engine.runner.attn.native
    assert native is not None and native.wait(), native and native.error  # decodes through the C kernel
    assert _tokens(llm) == ref
    assert llm.engine.block_manager.hit_tokens == 0
    assert _tokens(llm) == ref  # the same prompts again: their full blocks come from the prefix cache
    assert llm.engine.block_manager.hit_tokens >= 8 * sum(len(p) // 8 for p in PROMPTS) - 8 * len(PROMPTS)


# ---- MXFP4 ---------------------------------------------------------------------------------------
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A writer following the OCP MX layout: w [..., N, K] -> blocks [..., N, K/32, 16] uint8 (two e2m1 codes a
    byte, the even element in the low nibble), scales [..., N, K/32] uint8 (e8m0, bias 127). Each block of 32 gets
    the power of two that brings its largest magnitude to at most 6, and each value the nearest e2m1."""
    g = w.float().unflatten(-1, (-1, 32))  # [..., N, G, 32]
    amax = g.abs().amax(-1).clamp_min(2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # amax / 2**exp <= 6
    scaled = g / torch.exp2(exp)[..., None]
    code = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) | ((scaled < 0).to(torch.int64) << 3)
    pairs = code.unflatten(-1, (16, 2))
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    w = torch.randn(3, 40, 64) * torch.logspace(-3, 2, 40)[None, :, None]  # rows of very different magnitudes
    blocks, scales = pack_mxfp4(w)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, N, K]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]: their layout
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert (ours - w).abs().max() / w.abs().max() < 0.25  # and it is w, to 4 bits
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), ours.bfloat16())


def _mxfp4_pair(model, tmp_path):
    """The tiny model's experts packed to MXFP4 (checkpoint b, with a quantization_config as gpt-oss ships) and,
    beside it, the same model with the experts replaced by their dequantized values (checkpoint a, unquantized)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        shutil.copytree(model, d)
    tensors = load_file(str(model / "model.safetensors"))
    packed, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = pack_mxfp4(t.transpose(1, 2).contiguous())  # [E, N, K] rows, as gpt-oss packs them
            packed |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
            dequantized[name] = dequantize_mxfp4(blocks, scales, t.dtype).transpose(1, 2).contiguous()
        else:
            packed[name] = dequantized[name] = t
    save_file(dequantized, str(a / "model.safetensors"), metadata={"format": "pt"})
    save_file(packed, str(b / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((b / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (b / "config.json").write_text(json.dumps(cfg))
    return a, b


def test_an_mxfp4_checkpoint_gives_hf_tokens_on_its_dequantized_weights(model, tmp_path):
    """Our engine on the MXFP4 checkpoint (dequantized at load on CPU) gives HF's tokens on the dequantized one."""
    a, b = _mxfp4_pair(model, tmp_path)
    llm = LLM(model=str(b), dtype="float32", log_stats_interval=0)
    assert llm.engine.spec.mxfp4
    assert _tokens(llm) == [r[0] for r in hf_greedy(a, PROMPTS, 16)]
    assert _tokens(llm) != [r[0] for r in hf_greedy(model, PROMPTS, 16)]  # 4 bits changed the model: a real test


def test_fp8_experts_and_their_snapshot(model, tmp_path):
    kw = dict(model=str(model), dtype="bfloat16", log_stats_interval=0, cache_root=str(tmp_path))
    fp8 = LLM(quantization="fp8", **kw)
    layer = fp8.engine.model.layers[0]
    assert layer.w13.dtype == torch.float8_e4m3fn and layer.sinks.dtype == torch.float32
    want = _tokens(fp8)
    again = LLM(quantization="fp8", **kw)
    assert again.engine.weights_source == "fp8 snapshot" and _tokens(again) == want


def test_the_triton_kernels_give_hf_tokens(model, ref):
    """Sinks in the Triton attention kernels and biases + the clamped SwiGLU in the fused MoE kernel (under the
    interpreter here), through the whole model."""
    llm = LLM(model=str(model), dtype="float32", kernel_backend="triton", log_stats_interval=0)
    assert _tokens(llm) == ref


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_is_transformers(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rotary import _yarn

    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}  # fmt: skip
    cfg = GptOssConfig(hidden_size=128, num_attention_heads=2, head_dim=64, rope_parameters=dict(rope))
    inv, attn = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    ours, our_attn = _yarn(64, 150000.0, rope)
    assert torch.equal(ours, inv) and our_attn == attn


# ---- the planner: MXFP4 experts counted at 4.25 bits where they stay packed (a GPU) ----------------------------
def gpt_oss_config(layers: int, experts: int) -> dict:
    return {
        "architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": experts, "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "attention_bias": True, "swiglu_limit": 7.0, "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
    }  # fmt: skip


@pytest.mark.parametrize(
    "name, layers, experts, gib, weights_gb, kv_tokens",
    [("gpt-oss-20b", 24, 32, 24, (13.5, 14.0), 100_000), ("gpt-oss-120b", 36, 128, 80, (64.5, 65.5), 65_536)],
)
def test_the_planner_fits_gpt_oss_on_one_card(name, layers, experts, gib, weights_gb, kv_tokens):
    """gpt-oss-20b on a 24 GB card and gpt-oss-120b on an 80 GB one, as vLLM serves them: the experts at 4 bits and
    an e8m0 scale per 32 (17/32 of a byte a weight), the rest in bf16; the KV they leave (reported)."""
    from engine.models.spec import ModelSpec
    from warmup.plan import make_plan

    spec = ModelSpec.from_hf(gpt_oss_config(layers, experts))
    assert spec.mxfp4 and spec.quant is None
    p = make_plan(spec, gib * 2**30, max_model_len=32768)
    assert weights_gb[0] * 1e9 < p["weight_bytes"] < weights_gb[1] * 1e9, p["weight_bytes"] / 1e9
    assert p["fits"] and p["kv_tokens"] >= kv_tokens, p
    print(f"{name} on {gib} GiB: {p['weight_bytes'] / 1e9:.1f} GB of weights, {p['kv_tokens']:,} KV tokens")
    dequantized = make_plan(spec, gib * 2**30, max_model_len=32768, kernel_backend="torch")
    assert not dequantized["fits"]  # what they would take as bf16 does not fit: the 4 bits are what makes it


def test_mxfp4_experts_stay_4_bit_in_the_triton_kernels(model, tmp_path):
    """Where the Triton kernels run (forced here, under the interpreter), the MXFP4 experts load as their bytes and
    scales and the fused MoE kernel dequantizes them in its loop: HF's tokens on the dequantized weights."""
    a, b = _mxfp4_pair(model, tmp_path)
    llm = LLM(model=str(b), dtype="float32", kernel_backend="triton", log_stats_interval=0)
    layer = llm.engine.model.layers[0]
    assert layer.w13.dtype == torch.uint8 and layer.w13.shape[-1] == llm.engine.spec.hidden_size // 2
    assert layer.expert_scales["w13"].dtype == torch.uint8
    assert _tokens(llm) == [r[0] for r in hf_greedy(a, PROMPTS, 16)]


def test_chunked_prefill_with_preemption_keeps_hf_tokens(model):
    prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(n)] for i, n in enumerate((1, 7, 16, 33, 70))]
    ref = [r[0] for r in hf_greedy(model, prompts, 24)]
    llm = LLM(model=str(model), dtype="float32", log_stats_interval=0, max_num_batched_tokens=8, num_kv_blocks=8,
              max_model_len=128)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.engine.scheduler.num_preemptions > 0  # the window's and the full layers' blocks freed and recomputed


def test_the_spelled_out_prefill_in_query_slices_keeps_hf_tokens(model, ref, monkeypatch):
    """Sinks take the spelled-out attention on CPU, a slice of queries at a time (so a long chunk's scores never
    take gigabytes): slices of a few rows give the same tokens."""
    from engine.layers import attention

    monkeypatch.setattr(attention, "EXPLICIT_SCORES", 6 * 40)  # a few query rows a slice at these contexts
    llm = LLM(model=str(model), dtype="float32", log_stats_interval=0)
    assert _tokens(llm) == ref


def test_fp8_kv_calibrates_through_the_sinks(model, ref):
    """KV_CACHE_DTYPE=fp8 on a checkpoint without KV scales calibrates them in one forward pass, whose attention
    has the sinks too: it starts, its scales are finite, and the first tokens are HF's."""
    llm = LLM(model=str(model), dtype="float32", kv_cache_dtype="fp8", log_stats_interval=0)
    attn = llm.engine.runner.attn
    assert attn.k_scales is not None and torch.isfinite(attn.k_scales).all() and (attn.k_scales > 0).all()
    assert [t[:2] for t in _tokens(llm)] == [t[:2] for t in ref]
