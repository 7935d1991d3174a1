"""A scripted stand-in for engine.AsyncEngine, so that handler logic is tested in seconds without a model.

FakeAsyncEngine has exactly the surface the handler uses: validate, generate, abort, stats, tok, max_model_len,
lora_names, model_pooling, hidden_size. Validation is the engine's own (engine/intake.py over the model's real
tokenizer, vocabulary and context), so a job's errors are the real ones; only the model is scripted. Each of a
request's n sequences answers with REPLY's tokens, repeated (sequence i starts i tokens in), one token per step of
`step_s` seconds, until max_tokens: finish_reason is always "length" (no EOS, no stop strings). Logprobs are made up
but shaped as the engine's: the sampled token first, then the next ids, top-N in all; prompt_logprobs likewise, the
first None. An embedding request gets a made-up unit vector."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

from engine import (
    CompletionOutput,
    EngineConfig,
    EngineError,
    LoRARequest,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    Tokenizer,
    ValidRequest,
)
from engine.async_engine import is_part
from engine.intake import Intake
from engine.pooling import model_pooling

REPLY = " Paris. The quick brown fox jumps over the lazy dog, then it naps in the sun."
NUM_BLOCKS, BLOCK_SIZE = 1024, 16


class FakeAsyncEngine:
    def __init__(self, model: str | Path, *, max_model_len: int = 2048, step_s: float = 0.002, **config):
        """model: a model folder (its tokenizer and config.json's vocab_size); config: more EngineConfig fields
        (max_num_seqs, enable_lora, lora_modules ...) that validation reads."""
        cfg = EngineConfig(model=str(model), max_model_len=max_model_len, **config)
        self.tok = Tokenizer(model)
        self.max_model_len = max_model_len
        config_json = json.loads((Path(model) / "config.json").read_text())
        self.vocab_size, self.hidden_size = config_json["vocab_size"], config_json["hidden_size"]
        self.model_pooling = model_pooling(model)
        self._intake = Intake(self.tok, self.vocab_size, max_model_len, cfg)
        self._lora_names = sorted(name for name, _ in cfg.lora_modules)
        self._reply = self.tok.encode(REPLY, add_special_tokens=False)
        self._step_s = step_s
        self._blocks: dict[str, int] = {}  # running request id -> the KV blocks it holds
        self._errors: dict[str, BaseException] = {}  # request id -> what abort(rid, error) makes generate() raise
        self.unhealthy: str | None = None  # AsyncEngine's: never, here
        self._ids = itertools.count()

    def validate(
        self, prompt: str | dict, params: SamplingParams | None = None, lora: LoRARequest | None = None
    ) -> ValidRequest:
        return self._intake.validate(prompt, params, lora)

    def warm_later(self, *pieces) -> None:
        """AsyncEngine's: the pieces run on its loop's thread after ready; here at once."""
        for piece in pieces:
            piece()

    def release_idle(self) -> None:
        pass

    def lora_names(self) -> list[str]:
        return list(self._lora_names)

    def stats(self) -> dict:
        used = sum(self._blocks.values())
        return {
            "num_free_blocks": NUM_BLOCKS - used,
            "num_total_blocks": NUM_BLOCKS,
            "kv_usage": used / NUM_BLOCKS,
            "running": len(self._blocks),
            "waiting": 0,
            "num_preemptions": 0,
            "prefix_cache_queried_tokens": 0,  # the scripted model caches nothing
            "prefix_cache_hit_tokens": 0,
        }

    async def abort(self, request_id: str, error: BaseException | None = None, *, with_parts: bool = False) -> None:
        """Free the request now (with_parts: its "{request_id}/..." too); with `error`, its generate() raises it at
        its next step."""
        if error is not None and request_id in self._blocks:
            self._errors[request_id] = error
        for rid in [request_id, *(k for k in list(self._blocks) if with_parts and is_part(k, request_id))]:
            self._blocks.pop(rid, None)

    async def generate(
        self,
        prompt: str | dict | ValidRequest,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        valid = self.validate(prompt, params, lora)
        rid = request_id or f"fake-{next(self._ids)}"
        if rid in self._blocks:
            raise EngineError(f"request id {rid!r} is already in use")
        p, ids = valid.params, valid.prompt_token_ids
        self._blocks[rid] = p.n * -(-(len(ids) + p.max_tokens) // BLOCK_SIZE)
        seqs = [_Seq(self, p, i) for i in range(p.n)]
        arrival = time.monotonic()
        try:
            await asyncio.sleep(self._step_s)  # the prefill step
            if p.pooling is not None:  # an embedding: a made-up unit vector, at once
                k = p.pooling.dimensions or self.hidden_size
                yield RequestOutput(rid, ids, [], True, embedding=[float(i == len(ids) % k) for i in range(k)])
                return
            first, last, gaps = time.monotonic(), None, []
            for step in range(p.max_tokens):
                if (error := self._errors.pop(rid, None)) is not None:
                    raise error
                if rid not in self._blocks:  # aborted
                    return
                now = time.monotonic()
                gaps += [now - last] if last is not None else []
                last = now
                outputs = [s.step(step) for s in seqs]
                finished = step == p.max_tokens - 1
                out = RequestOutput(rid, ids, outputs, finished, prompt_logprobs=self._prompt_logprobs(ids, p))
                if finished:
                    out.metrics = RequestMetrics(
                        queue_time=0.0,  # scheduled at once
                        ttft=first - arrival,
                        mean_itl=sum(gaps) / len(gaps) if gaps else None,
                        max_itl=max(gaps) if gaps else None,
                        e2e_time=time.monotonic() - arrival,
                        prompt_tokens=len(ids),
                        cached_prompt_tokens=0,
                        output_tokens=p.n * p.max_tokens,
                        num_preemptions=0,
                    )
                yield out
                if not finished:
                    await asyncio.sleep(self._step_s)
        finally:
            self._blocks.pop(rid, None)
            self._errors.pop(rid, None)

    def logprobs(self, token: int, top_n: int) -> dict[int, float]:
        """The sampled token first, then the next ids: top_n entries (at least the sampled one)."""
        return {(token + k) % self.vocab_size: -0.25 - k for k in range(max(top_n, 1))}

    def _prompt_logprobs(self, ids: list[int], p: SamplingParams) -> list | None:
        if p.prompt_logprobs is None:
            return None
        return [None] + [self.logprobs(t, p.prompt_logprobs) for t in ids[1:]]


class _Seq:
    """One of a request's n sequences: its tokens, text and logprobs so far."""

    def __init__(self, eng: FakeAsyncEngine, params: SamplingParams, index: int):
        self.eng, self.params, self.index = eng, params, index
        self.ids: list[int] = []
        self.text = ""
        self.lps: list[dict[int, float]] | None = [] if params.logprobs is not None else None

    def step(self, step: int) -> CompletionOutput:
        reply = self.eng._reply
        token = reply[(self.index + step) % len(reply)]
        self.ids.append(token)
        if self.lps is not None:
            self.lps.append(self.eng.logprobs(token, self.params.logprobs))
        text = self.eng.tok.decode(self.ids, skip_special_tokens=self.params.skip_special_tokens)
        delta, self.text = text[len(self.text) :], text
        finish = "length" if step == self.params.max_tokens - 1 else None
        return CompletionOutput(
            self.index,
            self.text,
            list(self.ids),
            finish,
            logprobs=list(self.lps) if self.lps is not None else None,
            delta_text=delta,
            delta_token_ids=[token],
        )
