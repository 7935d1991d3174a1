"""Shared builders for tests: tiny random models of each supported architecture saved as real HF checkpoints
(with a trained byte-level BPE), the HF transformers greedy reference and vLLM's logprobs rule. conftest.py's
fixtures build on these; tests import them from here."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_VOCAB = 384

HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4)  # fmt: skip
HYBRID_MOE = dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, **HYBRID)  # fmt: skip
# name -> (transformers config class name, extra config)
TINY_ARCHS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3-rope-tied": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
    ),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    # a window shorter than most prompts: every layer attends to its last 6 positions only
    "mistral-window": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=6)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=48)),  # head_dim != hidden/heads
    # Gemma: soft-caps that clip, windows shorter than the prompts on alternate layers, a query scale that is not
    # head_dim's, and (Gemma 3) another rope base on the sliding layers; 4 layers so both layer kinds repeat
    "gemma2": (
        "Gemma2Config",
        dict(
            tie_word_embeddings=False,  # tied, the scaled embedding dominates and the argmax is the input token
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=6,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
    # longrope with short factors that matter (prompts stay below original_max_position_embeddings, where
    # transformers and the engine both use the short ones) and fused qkv_proj / gate_up_proj in the checkpoint
    "phi3": (
        "Phi3Config",
        dict(
            tie_word_embeddings=False,
            original_max_position_embeddings=128,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
                "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0],
            },
        ),
    ),
    # mixture of experts: routing that spreads over experts (random routers), top-2 of 4 / 5; Qwen2-MoE with its
    # shared expert and a dense first layer (mlp_only_layers), Qwen3-MoE with renormalized top-k and q/k norms
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        dict(
            tie_word_embeddings=False,
            num_hidden_layers=3,
            num_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            mlp_only_layers=[0],
        ),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            head_dim=16,
        ),
    ),
    # GPT-OSS: sinks, biases everywhere (randomized below: HF initializes most to zero), sliding (6) and full layers,
    # YaRN whose ramp falls inside these short prompts (original length 16), top-2 of 4 experts, a SwiGLU limit
    # low enough that its clamps cut
    "gpt-oss": (
        "GptOssConfig",
        dict(
            tie_word_embeddings=False,
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=6,
            swiglu_limit=0.4,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
                "rope_theta": 150000.0,
            },
        ),
    ),
    # hybrids: three Gated DeltaNet layers per gated full-attention layer, two value heads per key head, rope on a
    # quarter of head_dim; Qwen3-Next's MoE with a shared expert, Qwen3.5 dense, Qwen3.5-MoE (norms randomized below)
    "qwen3-next": ("Qwen3NextConfig", dict(decoder_sparse_step=1, mlp_only_layers=[], **HYBRID_MOE)),
    "qwen3.5": ("Qwen3_5TextConfig", dict(tie_word_embeddings=False, **HYBRID)),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", HYBRID_MOE),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            tie_word_embeddings=False,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        ),
    ),
}


def tiny_tokenizer(out: Path) -> None:
    """A byte-level BPE trained on a few sentences: real merges, real multi-byte handling."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Paged attention keeps KV blocks in a pool.",
        "Hello world! Bonjour le monde. Grüße, 世界 😀",
        "def step(self): schedule, run, postprocess",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.save_pretrained(str(out))


def build_tiny_model(out: Path, arch: str, *, seed: int = 0, init_range: float = 0.15, **overrides) -> Path:
    import transformers

    cls_name, extra = TINY_ARCHS[arch]
    base = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=init_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        attention_bias=arch == "qwen2",
    )
    if cls_name == "Qwen3_5MoeTextConfig":  # no dense MLP at all
        del base["intermediate_size"]
    cfg = getattr(transformers, cls_name)(**{**base, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch == "qwen2":  # random biases, so that a model ignoring them would fail the parity test
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if arch == "gpt-oss":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    p.normal_(0, 1.0 if name.endswith("sinks") else 0.3)
    if arch.startswith("qwen3.5") or arch == "qwen3-next":  # HF's norms start as (1 + 0), dt_bias as 1
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "dt_bias")):
                    p.uniform_(-0.5, 0.5)
    if arch == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(out), safe_serialization=True)
    tiny_tokenizer(out)
    return out


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int, top_n: int = 5):
    """HF transformers fp32 greedy, one prompt at a time (no padding). Returns (ids, [per-step top-N])."""
    from bench._common import hf_greedy as run

    return run(path, prompts, max_new_tokens, top_n)


def check_logprobs_close(
    ours: list[int], ours_lp: list[dict], ref: list[int], ref_lp: list[dict], name: str, atol: float = 1e-3
) -> None:
    """vLLM's rule (bench._common.logprobs_mismatch), asserted."""
    from bench._common import logprobs_mismatch

    why = logprobs_mismatch(ours, ours_lp, ref, ref_lp, atol)
    assert why is None, f"{name}: {why}"


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


def build_scripted_model(
    out: Path, script: list[str], after: str = "<|assistant|>", template: str | None = None, special: tuple = ()
) -> Path:
    """A tiny Llama that, once its input ends with the token `after`, writes `script` (each piece one token of its
    own, added to the tokenizer) and then its EOS, greedily, whatever came before: a real checkpoint through the
    real engine, with an output a test can choose (a think block, a tool call). How: attention and MLP write
    nothing into the residual stream (o_proj, down_proj zero), each piece's embedding is a one-hot direction, and
    lm_head maps that direction to the next piece's logit. `template`: the tokenizer's chat template; `special`: the
    pieces added as special tokens (which skip_special_tokens drops from the text)."""
    import transformers
    from tokenizers import AddedToken

    chain = [after, *script]
    assert len(set(chain)) == len(chain) <= 90, "each piece once, and fewer pieces than hidden dimensions"
    build_tiny_model(out, "llama")
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in chain if p not in special])
    if special:
        tok.add_special_tokens({"additional_special_tokens": [AddedToken(p, normalized=False) for p in special]})
    if template is not None:
        tok.chat_template = template
    ids = tok.convert_tokens_to_ids(chain)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for i, t in enumerate(ids):
            emb[t].zero_()
            emb[t, i] = 1.0
        for i in range(len(ids)):
            nxt = ids[i + 1] if i + 1 < len(ids) else model.config.eos_token_id
            head[nxt, i] = 10.0
    model.config.vocab_size = len(tok)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def unpacked_then_packed(llm, params) -> tuple[list, list]:
    """Three prompts generated with an engine's CPU linears unpacked, then again once IdleWork has packed them
    (LLM.generate drains its pieces first): (first outputs, second outputs)."""
    from engine.layers.dense import AVX2_PACKED, PACKED

    idle = llm.engine.idle
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 20)]
    idle.pack, pending = [], idle.pack
    first = llm.generate(prompts, params)
    assert pending and all(not hasattr(w, a) for piece in pending for w in piece for a in (PACKED, AVX2_PACKED))
    idle.pack = pending
    return first, llm.generate(prompts, params)
