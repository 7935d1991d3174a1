"""A Llama-shaped checkpoint of random bf16 weights on disk (HF names, sharded, with an index, a config and a small
trained tokenizer), for cold-start measurements of big models without downloading one."""

from __future__ import annotations

import json
from pathlib import Path

PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention keeps KV blocks in a pool."
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    num_hidden_layers=32,
)
# SmolLM2-135M's shape: the GPU check's parity model where the real one cannot be carried
SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    num_hidden_layers=30,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    num_hidden_layers=2,
)


def write_model(
    out: Path, shape: dict, device: str, shard_bytes: int = 2 << 30, std: float = 0.02, dtype: str = "bfloat16"
) -> list[Path]:
    """Random weights (normal, `std`) in `dtype`, HF names, sharded about every `shard_bytes`; returns the shard
    paths. `shape` may also set rope_theta, max_position_embeddings, tie_word_embeddings."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    tensors: list[tuple[str, tuple]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    tensors += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    gen = torch.Generator(device).manual_seed(0)
    shards, cur, cur_bytes, weight_map = [], {}, 0, {}

    def flush() -> None:
        nonlocal cur, cur_bytes
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(cur, str(out / name))
        weight_map.update({k: name for k in cur})
        shards.append(out / name)
        cur, cur_bytes = {}, 0

    dt = getattr(torch, dtype)
    for name, shp in tensors:
        if name == "lm_head.weight" and shape.get("tie_word_embeddings"):
            continue
        t = torch.empty(shp, dtype=dt, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0, std, generator=gen)
        cur[name] = t.cpu()
        cur_bytes += t.numel() * t.element_size()
        if cur_bytes >= shard_bytes:
            flush()
    if cur:
        flush()
    total = sum(f.stat().st_size for f in shards)
    final = []  # HF's names say how many shards there are: rename now that we know
    for i, f in enumerate(shards):
        dst = out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        f.rename(dst)
        final.append(dst)
    weight_map = {k: f"{Path(v).stem}-of-{len(shards):05d}.safetensors" for k, v in weight_map.items()}
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (out / "config.json").write_text(json.dumps(hf_config(shape, dtype)))
    _tokenizer(out)
    return final


def hf_config(shape: dict, dtype: str = "bfloat16") -> dict:
    """The config.json of a Llama of this shape (what ModelSpec.from_hf reads)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": dtype,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **shape,
    }


def _tokenizer(out: Path) -> None:
    """A byte-level BPE trained on two sentences (the model is random: any tokenizer will do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([PROMPT] * 10, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    ).save_pretrained(str(out))


def write_tiny_moe(out: Path, experts: int = 8, top_k: int = 2) -> Path:
    """A small Mixtral (4 layers, hidden 256, experts of 512, top-2 of 8, vocab 8192) with random weights, saved by
    transformers itself, plus a tokenizer: bench/throughput.py --moe's model."""
    import torch
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(str(out))
    _tokenizer(out)
    return out


def write_tiny_hybrid(out: Path, dtype: str = "bfloat16", toy: bool = False) -> Path:
    """A small Qwen3-Next (8 layers: 6 Gated DeltaNet and 2 gated attention, hidden 256, value heads 8 of 32 and
    key heads 4 of 32, experts of 256, top-2 of 8 with a shared expert, vocab 8192) with random weights, saved by
    transformers itself, plus a tokenizer: bench/throughput.py --hybrid's model. toy: 4 layers of hidden 64 and
    experts of 32 (bench/gpu_hybrid.py --tiny, under the Triton interpreter)."""
    import torch
    import transformers

    small = (
        dict(
            hidden_size=64,
            num_hidden_layers=4,
            head_dim=16,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
        if toy
        else {}
    )
    cfg = transformers.Qwen3NextConfig(**{**dict(
        vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    ), **small})  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype)).save_pretrained(str(out))
    _tokenizer(out)
    return out
