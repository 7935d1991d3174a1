"""Pydantic job schemas: worker-vllm's native job and the OpenAI request bodies (with vLLM's extras).

Unknown keys are rejected; every validation error becomes one JobError naming the field."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine import InvalidRequestError, SamplingParams

DEFAULT_MAX_TOKENS = 100  # worker-vllm's default when a native job omits max_tokens; stated in the output

log = logging.getLogger("handler")

# Fields accepted (clients send them) that change nothing here, and why. A request that sets one gets a warning in
# the log, once per field; tests/test_no_silent_fields.py holds every other field to a visible effect or a refusal.
IGNORED_FIELDS = {
    "user": "OpenAI's end-user id for abuse monitoring: this worker monitors nothing",
    "store": "OpenAI stores completions for later retrieval: this worker stores nothing",
    "metadata": "tags for stored completions (see store)",
    "service_tier": "OpenAI's processing tiers: this worker has one",
    "request_id": "worker-vllm accepts it and names the request by an id of its own; so does this worker (the job id)",
}
_warned: set[str] = set()


def warn_ignored(req: BaseModel, where: str) -> None:
    """Log, once per field for the process, that a request set a field in IGNORED_FIELDS."""
    for f in sorted(req.model_fields_set & IGNORED_FIELDS.keys() - _warned):
        if getattr(req, f) not in (None, False):
            _warned.add(f)
            log.warning("%s.%s is accepted and ignored: %s", where, f, IGNORED_FIELDS[f])


class JobError(Exception):
    """A user error in a job. `param` names the offending field (dotted path)."""

    def __init__(self, message: str, param: str | None = None, type: str = "invalid_request_error", code: int = 400):
        super().__init__(message)
        self.message, self.param, self.type, self.code = message, param, type, code

    def to_dict(self) -> dict:
        return {"error": {"type": self.type, "message": self.message, "param": self.param, "code": self.code}}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def sampling_params(kw: dict, where: str) -> SamplingParams:
    """SamplingParams from a request's fields; its checks' errors name the field under `where`."""
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        raise JobError(str(e), param=f"{where}.{e.field}" if e.field else where) from None
    except TypeError as e:
        raise JobError(str(e), param=where) from None


def parse(model: type[BaseModel], data: Any, where: str = ""):
    """Validate `data`, turning the first pydantic error into a JobError that names the field."""
    if not isinstance(data, dict):
        raise JobError(f"{where or 'input'} must be a JSON object, not {type(data).__name__}", param=where or None)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        # pydantic adds the union member it tried ("str", "list[str]") to the location: not a field name
        path = [p for p in err["loc"] if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
        loc = ".".join(str(p) for p in ([where] if where else []) + path)
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise JobError(f"{loc}: {msg}", param=loc or None) from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @field_validator("content")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list):  # OpenAI content parts: only text parts are supported
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v):
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
            return "".join(p["text"] for p in v)
        return v

    @model_validator(mode="after")
    def _content_needed(self):
        # an assistant turn may be content-less (OpenAI sends null with tool calls); the rest need text
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class _Guided(_Strict):
    """Structured-output fields (handler/guided.py): at most one of them may be set."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class NativeSamplingParams(_Guided):
    """vLLM's SamplingParams names (engine validation checks the ranges)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None


class LoRASpec(_Strict):
    name: str
    s3_uri: str | None = None


class NativeJob(_Strict):
    """worker-vllm's classic job input (plus `lora`: an adapter name, or {"name", "s3_uri"})."""

    prompt: str | None = None
    messages: list[Message] | None = None
    apply_chat_template: bool = False
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    max_batch_size: int | None = Field(default=None, ge=1)
    min_batch_size: int | None = Field(default=None, ge=1)
    batch_size_growth_factor: float | None = Field(default=None, ge=1)
    use_openai_format: bool = False
    request_id: str | None = None
    lora: str | LoRASpec | None = None


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the usage
    continuous_usage_stats: bool = False  # vLLM's: the running usage on every chunk (here without include_usage too)


class _OpenAIBase(_Guided):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)  # null: all the room the context leaves
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    # vLLM's extra sampling parameters, accepted in the body as vLLM's OpenAI server does
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI fields we cannot honour: accepted only when absent/null, so a client never gets a silent no-op
    logit_bias: dict[str, float] | None = None
    # OpenAI bookkeeping fields that do not change generation
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v


class ChatCompletionRequest(_OpenAIBase):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # handler/tool_calls.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (null, true: any number)
    # vLLM's extra: top-N logprobs of every prompt token, at the response's top level, as a native job gives them
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_whole(cls, v, info):
        if v is not None and info.data.get("stream"):  # as vLLM: only a whole response carries them
            raise ValueError("prompt_logprobs is not available with stream: true")
        return v


class CompletionRequest(_OpenAIBase):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's and vLLM's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            return v[0]
        return v

    @field_validator("suffix", "best_of")
    @classmethod
    def _unsupported(cls, v, info):
        if v and not (info.field_name == "best_of" and v == 1):
            raise ValueError(f"{info.field_name} is not supported")
        return v
