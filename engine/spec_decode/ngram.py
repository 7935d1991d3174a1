"""Prompt-lookup (n-gram) proposals: no model, no KV. For each sequence, the longest suffix n-gram
(prompt_lookup_max down to prompt_lookup_min tokens) that occurred earlier in prompt + output, and the k tokens
that followed its most recent earlier occurrence. Outputs that copy from the prompt (code edits, summaries,
RAG answers) are proposed whole runs at a time."""

from __future__ import annotations

import weakref

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, lo: int, hi: int, k: int) -> list[int]:
    """tokens: [L] int64, the sequence so far. Up to k proposed next tokens ([] when no n-gram recurs)."""
    n_tok = len(tokens)
    for n in range(min(hi, n_tok - 1), lo - 1, -1):
        suffix = tokens[n_tok - n :]
        # windows starting at 0 .. L-n-1: every earlier occurrence (the suffix itself starts at L-n)
        windows = sliding_window_view(tokens[: n_tok - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the most recent occurrence: what followed it comes next
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    """Keeps each sequence's tokens as a growing numpy array (appended to, not rebuilt, each step)."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self._arrays: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # req -> (buffer, filled)

    def propose(self, reqs, ks: list[int]) -> list[list[int]]:
        return [propose_ngram(self._tokens(r), self.lo, self.hi, k) for r, k in zip(reqs, ks)]

    def _tokens(self, req) -> np.ndarray:
        buf, filled = self._arrays.get(req, (None, 0))
        n = req.num_tokens
        if buf is None or len(buf) < n:
            new = np.empty(max(2 * n, 64), dtype=np.int64)
            if buf is not None:
                new[:filled] = buf[:filled]
            buf = new
        if filled < n:
            buf[filled:n] = req.token_slice(filled, n)
        self._arrays[req] = (buf, n)
        return buf[:n]
