"""Plain dataclasses that form the contracts between stages. Pure Python: no torch here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one constraint. `field` is the request field it came from, so a
    schema or grammar that does not compile fails its request with an error naming that field."""

    json: str | dict | None = None  # a JSON schema (a dict, or its text)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF (GBNF), as xgrammar reads it
    json_object: bool = False  # any JSON object (response_format {"type": "json_object"})
    field: str = "structured_outputs"
    # the constraint starts once the output has written these tokens (a reasoning parser's end marker: vLLM applies
    # the grammar to the answer, not the thinking); None: from the first token
    after: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.after is not None:
            object.__setattr__(self, "after", tuple(self.after))
            if not self.after or not all(isinstance(t, int) for t in self.after):
                raise InvalidRequestError(f"{self.field}: after must be token ids", field=self.field)
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise InvalidRequestError(
                f"{self.field}: give exactly one of json, regex, choice, grammar or json_object (got "
                f"{', '.join(set_) or 'none'})",
                field=self.field,
            )
        if self.choice is not None and not (self.choice and all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError(f"{self.field}: choice must be a non-empty list of strings", field=self.field)
        for k in ("regex", "grammar"):
            if getattr(self, k) is not None and not isinstance(getattr(self, k), str):
                raise InvalidRequestError(f"{self.field}: {k} must be a string", field=self.field)
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError(f"{self.field}: json must be a JSON schema object", field=self.field)

    @property
    def key(self) -> tuple:
        """What a compiled grammar is cached under (the field name is not part of it)."""
        import json as _json

        schema = _json.dumps(self.json, sort_keys=True) if isinstance(self.json, dict) else self.json
        return (schema, self.regex, self.choice, self.grammar, self.json_object)


POOLINGS = ("last", "mean", "cls")  # engine/pooling.py


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request (engine/pooling.py): the prompt's final hidden states pooled into one vector."""

    pooling: str = "last"  # one of POOLINGS
    normalize: bool = True
    dimensions: int | None = None  # keep the first k values, before normalizing (Matryoshka)

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise InvalidRequestError(f"pooling must be one of {POOLINGS}, not {self.pooling!r}", field="pooling")
        if self.dimensions is not None and not (isinstance(self.dimensions, int) and self.dimensions >= 1):
            raise InvalidRequestError(
                f"dimensions must be an integer >= 1, not {self.dimensions!r}", field="dimensions"
            )


@dataclass
class SamplingParams:
    """vLLM's names and defaults. Validated on construction; errors name the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # grammar-constrained decoding (xgrammar)
    prompt_logprobs: int | None = None  # top-N logprobs of every prompt token (the first has none)
    # token id -> bias added to its logit before sampling (vLLM's and OpenAI's); str keys (JSON) are parsed
    logit_bias: dict[int, float] | None = None
    pooling: PoolingParams | None = None  # an embedding: the prompt's prefill, pooled; nothing is sampled

    def __post_init__(self) -> None:
        self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            ("n", isinstance(self.n, int) and self.n >= 1, "must be an integer >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            (
                "top_k",
                isinstance(self.top_k, int) and self.top_k >= 0,
                "must be -1, 0 (disabled) or a positive integer",
            ),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            (
                "max_tokens",
                self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                "must be an integer >= 1",
            ),
            ("min_tokens", isinstance(self.min_tokens, int) and self.min_tokens >= 0, "must be an integer >= 0"),
            (
                "logprobs",
                self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
                "must be an integer in [0, 20]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None
                or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
                "must be an integer in [0, 20]",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            (
                "stop_token_ids",
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "must be non-negative integers",
            ),
            # torch.Generator.manual_seed takes 64 bits; sequence i of n uses seed + i
            (
                "seed",
                self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63),
                "must be an integer in [-2**63, 2**63)",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"SamplingParams.{name}={getattr(self, name)!r} {why}", field=name)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"SamplingParams.min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}",
                field="min_tokens",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0


MAX_LOGIT_BIAS_TOKENS = 1024  # vLLM's cap per request (MAX_NUM_LOGIT_BIAS_TOKENS): the per-step scatter stays small


def _logit_bias(bias) -> dict[int, float] | None:
    """vLLM's SamplingParams.from_optional: keys as int token ids (JSON gives strings), values clamped to
    [-100, 100]. Refused here, naming `logit_bias.<key>`: a key that is not an integer or is negative, a value that
    is not a number or is NaN, more than MAX_LOGIT_BIAS_TOKENS entries. Ids past the vocabulary: check_params."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequestError(
            f"SamplingParams.logit_bias must be a dict of token id to bias, not {type(bias).__name__}",
            field="logit_bias",
        )
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequestError(
            f"SamplingParams.logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_TOKENS}", field="logit_bias"
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        tid = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str):
            try:
                tid = int(key)
            except ValueError:
                pass
        if tid is None or tid < 0:
            raise InvalidRequestError(
                f"SamplingParams.logit_bias key {key!r} is not a token id (an integer >= 0)", field=f"logit_bias.{key}"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise InvalidRequestError(
                f"SamplingParams.logit_bias[{key!r}]={value!r} must be a number", field=f"logit_bias.{key}"
            )
        out[tid] = float(min(100, max(-100, value)))  # clamped before float(): a huge int would overflow it
    return out or None  # {} biases nothing: the sampler's fast path stays open


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter: a name resolved through LORA_MODULES / LORA_S3_URI, or an explicit s3_uri (allowed
    only for buckets in LORA_ALLOWED_BUCKETS)."""

    name: str
    s3_uri: str | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence the scheduler runs. A request with n > 1 becomes n of these (see LLMEngine)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. Reset to 0 by recompute preemption.
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)  # owned by BlockManager
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Per-position top-N logprobs, filled by the engine when params.logprobs is set.
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # Seeded requests carry their own RNG state (a torch.Generator), owned by the sampler.
    generator: Any = None
    # A structured-output request's xgrammar GrammarMatcher: it has accepted every output token so far
    matcher: Any = None
    # the output length at which the grammar ended (terminated, or refused a token the other rules forced): it stops
    grammar_stop_at: int | None = None
    # structured_outputs.after, until the output has written it: the matcher waits (no mask, no token fed)
    grammar_after: tuple[int, ...] | None = None
    # Per prompt position, top-N logprobs (None for the first token), when params.prompt_logprobs is set
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Prefix caching (owned by BlockManager). cache_key: the extra keys hashed into every block (the
    # adapter, ...); () = this request neither shares nor registers blocks.
    cache_key: tuple = ()
    lora_key: str | None = None  # the adapter's identity (sha256 of its URI); None = the base model
    lora_slot: int = -1  # its device slot, set at admission
    state_slot: int = -1  # a hybrid model's state slot while it runs (engine/state_slots.py)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks so far
    num_registered_blocks: int = 0
    # Set by the scheduler at first admission (output-side metrics live in engine/output.py's SeqStats)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache
    first_scheduled_time: float | None = None  # monotonic seconds
    # params.pooling (engine/pooling.py): the sum (mean) or the first state (cls) so far, the prompt positions
    # pooled, and at the prompt's end the vector
    pooled: Any = None
    num_pooled: int = 0
    embedding: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the full list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class SchedulerOutput:
    """What runs this step. The runner reads it; nothing here is a tensor."""

    # Requests in batch order, and how many new tokens each contributes
    # (a decode contributes 1; a prefill chunk contributes up to the token budget).
    requests: list[Request]
    num_scheduled_tokens: list[int]
    # Requests preempted this step (their blocks are already freed).
    preempted: list[Request] = field(default_factory=list)
    # Speculative decoding: lookahead slots granted to decoding requests (counted in num_scheduled_tokens)
    spec: dict[Request, int] = field(default_factory=dict)
    # The requests that sample this step, in batch order: each whose scheduled tokens reach its last token
    sampling: list[Request] = field(default_factory=list)
    # Requests that failed (finished by the output processor), with why: refused for good by the admission gate
    # (their adapter failed to load), or failed in the step (engine/faults.py: NaN logits, out of memory twice)
    failed: dict[Request, BaseException] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True)
class StepOutput:
    """What one step produced, per request that sampled (host values: the step runner's answer)."""

    # one token, or with speculation the accepted drafts then the target's own token
    tokens: dict[Request, list[int]]
    logprobs: dict[Request, list[dict]]  # top-N per emitted token, for the requests that asked
    failed: dict[Request, BaseException] = field(default_factory=dict)  # rows with NaN or infinite logits


@dataclass
class CompletionOutput:
    """One of the n sequences of a request. `text`/`token_ids` are cumulative; `delta_*` is what is new."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request latency and token counts, on the finished output (seconds; None = not reached)."""

    queue_time: float | None  # arrival -> first scheduled
    ttft: float | None  # arrival -> first output token
    mean_itl: float | None  # mean gap between a sequence's consecutive output tokens
    max_itl: float | None
    e2e_time: float  # arrival -> the output that carries these metrics
    prompt_tokens: int
    cached_prompt_tokens: int  # prompt tokens whose KV came from the prefix cache
    output_tokens: int
    num_preemptions: int
    # speculative decoding, when on: draft_tokens, accepted_tokens, acceptance_rate, mean_acceptance_length (tokens
    # per verification step, the target's own included) and accepted_per_pos (rate at each draft position)
    spec_decode: dict | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_preemptions: int = 0
    metrics: RequestMetrics | None = None  # set on the finished output
    error: Exception | None = None  # the request failed (e.g. its adapter could not be loaded); finished
    # SamplingParams.prompt_logprobs: per prompt position top-N {token: logprob} and the prompt's own token; the
    # first position has None (nothing predicts it)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | None = None  # SamplingParams.pooling: the pooled vector, on the finished output
