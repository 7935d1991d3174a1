"""Structured output: grammar-constrained decoding with xgrammar (vLLM's default backend).

- Compile: a request's StructuredOutputsParams (a JSON schema, any JSON object, a regex, a choice of strings, an
  EBNF grammar) compiles on one background thread, cached per grammar (the tokenizer is this engine's). xgrammar
  itself is imported on that thread, the first time a request needs it: a worker that never serves one never
  pays its import. AsyncEngine awaits the compile before it queues the request, so the request waits (and a bad
  schema fails it alone, with an error naming its field) while the step loop runs on; LLM compiles inline.
- Each step: the rows of constrained requests get their token bitmask filled on the host (the forward pass runs
  meanwhile on a GPU: the fill happens after its launch) and applied to their logits before sampling, so every
  other sampling parameter still applies to what the grammar allows. After sampling, each matcher accepts its
  token; one that has terminated (the grammar is complete and a stop token came) finishes its request with
  "stop". When the grammar is complete only stop tokens are allowed.
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

log = logging.getLogger("engine")
CACHE_ENTRIES = 512  # compiled grammars kept (LRU); each is small (a bitmask automaton over the vocabulary)


class StructuredOutputs:
    def __init__(self, tokenizer_json: str, vocab: dict[str, int], vocab_size: int, stop_token_ids: list[int]):
        self._tok = (tokenizer_json, vocab, vocab_size, sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self._compiler = None  # made on the compile thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (not served from the cache)

    @classmethod
    def of(cls, tok, vocab_size: int, eos_token_ids) -> StructuredOutputs:
        """For an engine Tokenizer (its Rust tokenizer, or transformers' fast one's backend)."""
        backend = tok.backend or tok.hf.backend_tokenizer
        return cls(backend.to_str(), backend.get_vocab(with_added_tokens=True), vocab_size, list(eos_token_ids))

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

            tokenizer_json, vocab, vocab_size, stops = self._tok
            encoded = [""] * vocab_size
            for token, i in vocab.items():
                if i < vocab_size:
                    encoded[i] = token
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)  # what from_huggingface reads
            info = xgr.TokenizerInfo(
                encoded,
                vocab_type=meta["vocab_type"],
                vocab_size=vocab_size,
                stop_token_ids=stops,
                add_prefix_space=meta["add_prefix_space"],
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def matcher(self, p: StructuredOutputsParams):
        """A fresh matcher for one sequence (blocks until the grammar is compiled: LLM's path)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(p).result())

    # ---- each step (the engine thread) ------------------------------------------------------------------
    def fill(self, reqs: list[Request], drafts: list[list[int]] | None = None) -> tuple[torch.Tensor, list[int]] | None:
        """The token bitmask of each constrained sampling row ([rows, ceil(vocab / 32)] int32 on the host) and those
        rows, or None when no row is constrained. With speculation a request has one row per draft plus one: row
        j is masked as the grammar stands after drafts 1..j (the matcher advances through them, then rolls back;
        a draft the grammar refuses ends the run there, since its own row's mask then rejects it)."""
        drafts = drafts or [[] for _ in reqs]
        if all(r.matcher is None for r in reqs):
            return None
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(sum(len(d) + 1 for d in drafts), self.vocab_size)  # all ones: all allowed
        rows, row = [], 0
        for req, ds in zip(reqs, drafts):
            m = req.matcher
            if m is not None:
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
        return mask, rows

    @staticmethod
    def apply(logits: torch.Tensor, fill: tuple[torch.Tensor, list[int]]) -> None:
        """Disallowed tokens' logits become -inf, in place, in the constrained rows only. logits: [S, vocab] fp32."""
        import xgrammar as xgr

        mask, rows = fill
        xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True), indices=rows)

    @staticmethod
    def accept(sampled: dict[Request, list[int]]) -> None:
        """Advance each constrained sequence's matcher by its sampled tokens (before the scheduler appends them). The
        mask allowed them, unless another rule removed every allowed token (min_tokens masks the stop token a
        complete grammar leaves): then the sequence stops at that token, rather than the step failing everyone.
        Where the grammar ends is recorded as an output length (`grammar_stop_at`), so the scheduler stops a run
        of accepted drafts exactly there."""
        for req, tokens in sampled.items():
            m = req.matcher
            if m is None or req.grammar_stop_at is not None:
                continue
            for j, token in enumerate(tokens):
                ok = m.accept_token(token)
                if not ok:
                    log.warning("%s: the grammar allows no token here; the sequence stops", req.request_id)
                if not ok or m.is_terminated():
                    req.grammar_stop_at = len(req.output_token_ids) + j + 1
                    break

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
