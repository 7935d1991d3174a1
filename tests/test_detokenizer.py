"""Incremental detokenization on the real SmolLM2 tokenizer: no half characters, stop strings across tokens."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


class _Dec:
    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


TEXT = "Grüße aus München! 😀🚀 世界 — naïve café, done."


def _stream(tok, text, stop=(), include=False, prompt="Say:"):
    prompt_ids = tok(prompt).input_ids
    ids = tok(text).input_ids
    d = IncrementalDetokenizer(_Dec(tok), prompt_ids, list(stop), include, True)
    deltas, hit = [], None
    for t in ids:
        hit = d.add_token(t)
        deltas.append(d.pop_delta(finished=hit is not None))
        if hit:
            break
    deltas.append(d.pop_delta(finished=True))
    return deltas, d, hit


def test_no_half_characters_and_concat_equals_decode(tok):
    ids = tok(TEXT).input_ids
    assert len(ids) > len(TEXT.split())  # multi-byte chars really are split across tokens
    deltas, d, _ = _stream(tok, TEXT)
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == d.text == tok.decode(ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    stop = "München! 😀"  # several tokens, multi-byte
    deltas, d, hit = _stream(tok, TEXT, stop=[stop], include=include)
    assert hit == stop
    cut = TEXT.index(stop) + (len(stop) if include else 0)
    assert "".join(deltas) == TEXT[:cut]


def test_streaming_holds_back_possible_stop_prefix(tok):
    # "Mün" could be the start of the stop string: it must not be streamed before it is ruled out
    d = IncrementalDetokenizer(_Dec(tok), [], ["München!?"], False, True)
    emitted = ""
    for t in tok(TEXT).input_ids:
        d.add_token(t)
        emitted += d.pop_delta(finished=False)
        assert not TEXT[len(emitted) :].startswith("München!") or "Mün" not in emitted[-3:]
    emitted += d.pop_delta(finished=True)
    assert emitted == TEXT
