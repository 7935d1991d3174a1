"""Incremental detokenization with stop strings. Pure Python over a `tokenizers.Tokenizer`."""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


# Tokens of context decoded before the new ones, so that pieces like SentencePiece's leading
# space or byte-level merges render the same as in a full decode.
_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    Never emits half a UTF-8 character: a window that decodes to a trailing U+FFFD waits for more
    tokens. Stop strings may span tokens; text that could still become a stop string is held back
    from `pop_delta` until the request finishes."""

    def __init__(
        self, decoder: Decoder, prompt_ids: list[int], stop: list[str], include_stop: bool, skip_special_tokens: bool
    ):
        self.decoder = decoder
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0  # chars of self.text already returned by pop_delta

    def add_token(self, token_id: int, emit: bool = True) -> str | None:
        """Append one token. Returns the stop string it completed, if any (text is then truncated).

        `emit=False` appends the id without text (an EOS or stop token id that must not render)."""
        if not emit:
            return None
        self.ids.append(token_id)
        prefix = self.decoder.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.decoder.decode(self.ids[self.prefix_offset :], self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        start = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._find_stop(start)

    def _find_stop(self, new_from: int) -> str | None:
        for s in self.stop:
            # Only a match that ends in the new text is new: search from len(s)-1 chars before it.
            i = self.text.find(s, max(0, new_from - len(s) + 1))
            if i >= 0:
                self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
                self.sent = min(self.sent, len(self.text))
                return s
        return None

    def pop_delta(self, finished: bool) -> str:
        end = len(self.text) if finished or not self.stop else max(self.sent, len(self.text) - self.holdback)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
