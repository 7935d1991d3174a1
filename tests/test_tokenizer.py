"""engine/tokenizer.py: the Rust tokenizer used from the start must encode exactly as transformers does, and
the engine switches to transformers if they ever disagree."""
from __future__ import annotations

import pytest

from engine.tokenizer import PROBE, Tokenizer

TEXTS = [PROBE, "The capital of France is", "  leading spaces and trailing  ", "<|im_start|>system\nHi<|im_end|>",
         "def f(x):\n\treturn x ** 2  # ünïcödé", ""]


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_encodes_like_transformers(which, tiny_llama, smollm2_path):
    from transformers import AutoTokenizer

    folder = tiny_llama if which == "tiny" else smollm2_path
    tok, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert tok.encode(text) == hf(text).input_ids, text
    assert tok.eos_token_id == hf.eos_token_id
    ids = hf(PROBE).input_ids
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) if which == "smollm2" \
        else tok.hf is not None
    assert not tok._use_hf_encode


def test_switches_to_transformers_on_disagreement(tiny_llama):
    tok = Tokenizer(tiny_llama)
    want = tok.hf(PROBE).input_ids

    class Wrong:  # a backend that disagrees with transformers
        def encode(self, text):
            return type("E", (), {"ids": [1, 2, 3]})()

    tok.backend = Wrong()
    tok._load_hf()  # what the background thread does
    assert tok._use_hf_encode and tok.encode(PROBE) == want
