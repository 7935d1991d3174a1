"""SpeculativeConfig: vLLM's `speculative_config` (worker-vllm's SPECULATIVE_CONFIG), frozen and validated.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
    {"model": "<local folder or HF id>", "num_speculative_tokens": k}        (method "draft_model")

Errors name the field as `speculative_config.<field>`."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from engine.errors import ConfigError

METHODS = ("ngram", "draft_model")
NGRAM_DEFAULT = 5  # vLLM's prompt_lookup_min and _max when neither is given


def _refused(name: str | None, rest: str) -> ConfigError:
    """An error on `speculative_config.<name>` (the whole config when None): the message starts with that path,
    and ConfigError.field is it, so the worker names SPECULATIVE_CONFIG without reading the message."""
    field = f"speculative_config.{name}" if name else "speculative_config"
    return ConfigError(field + rest, field=field)


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    method: str = "ngram"
    model: str | None = None  # the draft model (method draft_model)
    prompt_lookup_min: int | None = None  # n-gram sizes tried, longest first
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise _refused(name, f"={getattr(self, name)!r}: {why}")

        k = self.num_speculative_tokens
        need(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 16, "num_speculative_tokens",
             "must be an integer in [1, 16]")  # fmt: skip
        need(self.method in METHODS, "method", f"must be one of {METHODS}")
        if self.method == "draft_model":
            need(isinstance(self.model, str) and bool(self.model), "model", "a draft model needs a folder or HF id")
            need(self.prompt_lookup_min is None and self.prompt_lookup_max is None, "prompt_lookup_min",
                 "applies to method ngram only")  # fmt: skip
            return
        need(self.model is None, "model", "method ngram takes no model (set method draft_model, or leave it out)")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            need(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), name,
                 "must be an integer >= 1")  # fmt: skip
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = NGRAM_DEFAULT
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)  # one given: both take it (vLLM)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        need(lo <= hi, "prompt_lookup_min", f"must not exceed prompt_lookup_max={hi}")

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text (the env var); None, "" and {} mean off."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise _refused(None, f" is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise _refused(None, f" must be a JSON object, not {type(value).__name__}")
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise _refused(unknown[0], f": unknown key (known: {', '.join(sorted(known))})")
        if "num_speculative_tokens" not in value:
            raise _refused("num_speculative_tokens", ": required")
        value = dict(value)
        if value.get("method") in ("[ngram]", "ngram"):
            value["method"] = "ngram"
        elif value.get("method") in (None, "draft_model") and value.get("model"):
            value["method"] = "draft_model"  # vLLM infers the method from a model
        return cls(**value)

    def describe(self) -> str:
        k = self.num_speculative_tokens
        if self.method == "ngram":
            return f"ngram (k={k}, n-grams {self.prompt_lookup_max}..{self.prompt_lookup_min})"
        return f"draft model {self.model} (k={k})"
