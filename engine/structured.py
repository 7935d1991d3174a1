"""Structured output: grammar-constrained decoding with xgrammar (vLLM's default backend).

- Compile: a request's StructuredOutputsParams (a JSON schema, any JSON object, a regex, a choice of strings, an
  EBNF grammar) compiles on one background thread, cached per grammar (the tokenizer is this engine's). xgrammar
  itself is imported on that thread, the first time a request needs it: a worker that never serves one never
  pays its import. AsyncEngine awaits the compile before it queues the request, so the request waits (and a bad
  schema fails it alone, with an error naming its field) while the step loop runs on; LLM compiles inline.
- Each step: the engine asks for the constrained sampling rows' masks (`masks`); the step runner applies them to
  those rows' logits before sampling (they are filled on the host then, while a GPU still runs the forward pass),
  so every other sampling parameter still applies to what the grammar allows. The scheduler advances each
  matcher by its sequence's tokens, next to the other stop rules; one that has terminated (the grammar is
  complete and a stop token came) finishes its request with "stop". When the grammar is complete only stop
  tokens are allowed.
- Each sequence (n > 1: each of them) has its own matcher, owned by its Request. Preemption recomputes the KV but
  keeps the output tokens, which the matcher has accepted already, so it stays valid. Prefix caching, chunked
  prefill and LoRA change nothing here: only the rows that sample are masked.

JSON is generated without free whitespace (xgrammar's any_whitespace=False, vLLM's disable-any-whitespace): a small
model left free to emit whitespace can loop on it until max_tokens."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.errors import InvalidRequestError
from engine.types import Request, StructuredOutputsParams
from kernels.grammar_mask import apply_token_bitmask, new_bitmask

log = logging.getLogger("engine")
CACHE_ENTRIES = 512  # compiled grammars kept (LRU); each is small (a bitmask automaton over the vocabulary)


class StructuredOutputs:
    def __init__(self, tok, vocab_size: int, stop_token_ids):
        """tok: the engine's Tokenizer. Nothing is read from it here: its vocabulary is read, and xgrammar imported,
        on the compile thread when the first constrained request comes."""
        self._tok = tok
        self._stops = sorted(stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = None  # made on the compile thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (not served from the cache)

    # ---- compile (any thread) --------------------------------------------------------------------------
    def compile(self, p: StructuredOutputsParams) -> Future:
        """The compiled grammar of `p`, as a future (cached per grammar). A grammar that cannot be compiled
        raises InvalidRequestError naming p.field from the future."""
        with self._lock:
            fut = self._cache.get(p.key)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._cache[p.key] = self._pool.submit(self._compile, p)
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(p.key)
            return fut

    def _compile(self, p: StructuredOutputsParams):
        compiler = self._get_compiler()
        self.compiles += 1
        try:
            if p.json_object:  # any JSON object, without free whitespace either
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if p.json is not None:
                schema = p.json if isinstance(p.json, str) else json.dumps(p.json)
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if p.regex is not None:
                return compiler.compile_regex(p.regex)
            if p.choice is not None:
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in p.choice))
            return compiler.compile_grammar(p.grammar)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
            why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"{p.field}: cannot compile this constraint: {why}", field=p.field) from None

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr  # ~2 s the first time: on this thread, off the request path

            backend = self._tok.backend or self._tok.hf.backend_tokenizer  # Rust, or transformers' fast one's
            encoded = [""] * self.vocab_size
            for token, i in backend.get_vocab(with_added_tokens=True).items():
                if i < self.vocab_size:
                    encoded[i] = token
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())  # what from_huggingface reads
            info = xgr.TokenizerInfo(
                encoded,
                vocab_type=meta["vocab_type"],
                vocab_size=self.vocab_size,
                stop_token_ids=self._stops,
                add_prefix_space=meta["add_prefix_space"],
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def matcher(self, p: StructuredOutputsParams):
        """A fresh matcher for one sequence (blocks until the grammar is compiled: LLM's path)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(p).result())

    # ---- each step (the engine thread) ------------------------------------------------------------------
    def masks(self, reqs: list[Request], drafts: dict[Request, list[int]]) -> GrammarMasks:
        """The token bitmasks of this step's sampling rows: `reqs` in batch order, each with one row per draft
        and one more."""
        if all(r.matcher is None or r.grammar_after is not None for r in reqs):
            return NO_MASKS
        return GrammarMasks(reqs, [drafts.get(r, []) for r in reqs], self.vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarMasks:
    """One step's token bitmasks for its constrained sampling rows, filled on the host when applied (after the
    forward pass is launched: on a GPU the two overlap). With speculation a request has one row per draft plus
    one: row j is masked as the grammar stands after drafts 1..j (the matcher advances through them, then rolls
    back; a draft the grammar refuses ends the run there, since its own row's mask then rejects it)."""

    def __init__(self, reqs: list[Request], drafts: list[list[int]], vocab_size: int):
        self.reqs, self.drafts, self.vocab_size = reqs, drafts, vocab_size

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits become -inf, in place, in the constrained rows only. logits: [S, vocab] fp32."""
        if not self.reqs:
            return
        mask = new_bitmask(logits.shape[0], self.vocab_size, logits.device)  # [S, ceil(vocab / 32)], all allowed
        rows, row = [], 0
        for req, ds in zip(self.reqs, self.drafts):
            m = req.matcher
            if m is not None and req.grammar_after is None:  # (one waiting for its marker: not yet)
                advanced = 0
                for j in range(len(ds) + 1):
                    if m.is_terminated():
                        break
                    m.fill_next_token_bitmask(mask, row + j)
                    rows.append(row + j)
                    if j == len(ds) or not m.accept_token(ds[j]):
                        break
                    advanced += 1
                if advanced:
                    m.rollback(advanced)
            row += len(ds) + 1
        apply_token_bitmask(logits, mask, rows)


NO_MASKS = GrammarMasks([], [], 0)  # no constrained row this step
