"""Request intake: a prompt, its sampling parameters and its adapter, checked once against this engine.

`Intake.validate` returns a ValidRequest or raises InvalidRequestError naming the field. AsyncEngine.generate and
LLMEngine.add_request trust a ValidRequest and check nothing again. It reads only what is fixed at start (the
tokenizer, the vocabulary, the context, the config), so the event loop may call it while the engine thread steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.lora.source import AdapterRef, resolve
from engine.types import LoRARequest, SamplingParams

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class ValidRequest:
    """A request this engine accepts as it is."""

    prompt_token_ids: list[int]  # ints in [0, vocab_size), at least 1 and at most max_model_len - 1 of them (an
    # embedding's: max_model_len)
    params: SamplingParams  # within this engine's limits: n, stop_token_ids, logit_bias ids
    lora: AdapterRef | None = None  # the adapter, resolved to where it is read from (None: the base model)


@dataclass(frozen=True)
class Intake:
    """What checking a request reads of an engine."""

    tok: Tokenizer
    vocab_size: int
    max_model_len: int
    cfg: EngineConfig  # max_num_seqs, and how adapter names resolve (enable_lora, lora_modules, buckets)
    generates: bool = True  # False: the model has no LM head and serves embeddings only

    def validate(
        self,
        prompt: str | dict | ValidRequest,
        params: SamplingParams | None = None,
        lora: LoRARequest | None = None,
    ) -> ValidRequest:
        """The adapter first (a bad name fails before the prompt is tokenized), then the prompt, then the params.
        A ValidRequest was checked already and passes as it is."""
        if isinstance(prompt, ValidRequest):
            if params is not None or lora is not None:
                raise ValueError("a ValidRequest carries its params and adapter: pass neither again")
            return prompt
        ref = resolve(self.cfg, lora.name, lora.s3_uri) if lora is not None else None
        embedding = params is not None and params.pooling is not None
        ids = self.tokenize(prompt, room=0 if embedding else 1)  # an embedding generates nothing
        params = params if params is not None else SamplingParams()
        self.check_params(params)
        return ValidRequest(ids, params, ref)

    def tokenize(self, prompt: str | dict, room: int = 1) -> list[int]:
        """Prompt text or {"prompt_token_ids": [...]} -> token ids that fit this engine with `room` tokens to
        generate."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise InvalidRequestError("a dict prompt needs 'prompt_token_ids'", field="prompt")
            ids = list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone UTF-16 surrogate ("\ud800") from a JSON escape
                raise InvalidRequestError(
                    f"the prompt is not valid Unicode text: {e.reason} at character {e.start}", field="prompt"
                ) from None
            ids = self.tok.encode(prompt)
        else:
            raise InvalidRequestError(f"prompt must be a str or a dict, not {type(prompt).__name__}", field="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", field="prompt")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(
                f"prompt_token_ids must be ints in [0, {self.vocab_size})", field="prompt_token_ids"
            )
        if len(ids) + room > self.max_model_len:
            more = " and at least one token must be generated" if room else ""
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}{more}", field="prompt"
            )
        return ids

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the limits of this engine."""
        if params.n > self.cfg.max_num_seqs:  # n sequences must fit one batch (and n loops run on the engine thread)
            raise InvalidRequestError(
                f"n={params.n} is more than this worker runs at once (max_num_seqs={self.cfg.max_num_seqs})", field="n"
            )
        if params.pooling is None and not self.generates:
            raise InvalidRequestError(
                "this model has no LM head (its checkpoint is a base model's): it serves embeddings only "
                "(/v1/embeddings)",
                field="model",
            )
        if params.pooling is not None and params.n != 1:
            raise InvalidRequestError("an embedding request has one sequence (n=1)", field="n")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", field="stop_token_ids"
            )
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:  # vLLM's input processor refuses these too (_validate_logit_bias)
            raise InvalidRequestError(
                f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                field=f"logit_bias.{bad[0]}",
            )
