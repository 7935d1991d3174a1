"""The offline API, shaped like vLLM's: LLM(model).generate(prompts, params) -> outputs in input order."""
from __future__ import annotations

import itertools
from typing import Sequence

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.types import RequestOutput, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | dict | Sequence[str | dict],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        # Tokenize and validate everything first, so a bad prompt fails before any work starts.
        ids = [self.engine.tokenize(p) for p in prompts]
        order = {}
        for i, (p, tok, sp) in enumerate(zip(prompts, ids, params)):
            rid = f"llm-{next(self._ids)}"
            order[rid] = i
            self.engine.add_request(rid, p, sp, prompt_token_ids=tok)
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        results[order[out.request_id]] = out
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        return results
