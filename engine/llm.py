"""The offline API, shaped like vLLM's: LLM(model).generate(prompts, params) -> outputs in input order."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.cpu_threads import ThreadGovernor
from engine.llm_engine import LLMEngine
from engine.types import LoRARequest, PoolingParams, RequestOutput, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: LoRARequest | None | Sequence[LoRARequest | None] = None,
    ) -> list[RequestOutput]:
        """Outputs in input order. `lora`: one adapter for all prompts, or one (or None) per prompt. A request
        that fails (its adapter cannot be loaded) raises its error."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        # Validate everything first, so a bad request fails before any work starts.
        valid = [self.engine.validate(p, sp, lr) for p, sp, lr in zip(prompts, params, loras)]
        order = {}
        for i, v in enumerate(valid):
            rid = f"llm-{next(self._ids)}"
            order[rid] = i
            self.engine.add_request(rid, v)
        # a batch API: the kernel warm-up, then the graphs this batch can use, before its first step
        self.engine.idle.drain(batch=sum(sp.n for sp in params))
        results: list[RequestOutput | None] = [None] * len(prompts)
        # on CPU: the steps run on fewer threads while another process holds a core (engine/cpu_threads.py)
        eng, gov = self.engine, None
        try:
            gov = ThreadGovernor.for_calling_thread(eng.device, eng.cfg.tensor_parallel_size, torch.get_num_threads())
            while self.engine.has_unfinished():
                if gov is not None:
                    gov.before_step()
                outs = self.engine.step()
                if gov is not None:
                    gov.after_step()
                for out in outs:
                    if out.error is not None:
                        raise out.error
                    if out.finished:
                        results[order[out.request_id]] = out
                if not outs and not self.engine.scheduler.running:
                    time.sleep(0.01)  # everything waits for an adapter download
                    if gov is not None:
                        gov.restart()
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        finally:
            if gov is not None:
                gov.close()  # the thread's count back to the engine's
        return results

    def embed(
        self, prompts: str | dict | Sequence[str | dict], pooling: PoolingParams | None = None
    ) -> list[list[float]]:
        """One vector per prompt, in input order (engine/pooling.py; by default the last token's state, normed)."""
        params = SamplingParams(max_tokens=1, pooling=pooling or PoolingParams())
        return [out.embedding for out in self.generate(prompts, params)]
