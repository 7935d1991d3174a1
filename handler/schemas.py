"""Pydantic job schemas: worker-vllm's native job and the OpenAI request bodies (with vLLM's extras).

Unknown keys are rejected; every validation error becomes one JobError naming the field."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine import InvalidRequestError, SamplingParams
from handler import unservable
from handler.messages import check_field
from handler.openai_compat import STATUS, error

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
    "safety_identifier": "OpenAI's end-user id for abuse detection (see user)",
    "prompt_cache_key": "OpenAI's cache-routing key: the prefix cache here finds shared prefixes by itself",
    "prompt_cache_options": "OpenAI's cache breakpoints and lifetimes: the prefix cache here is automatic (LRU)",
    "prompt_cache_retention": "OpenAI's cache lifetime: the prefix cache here is automatic (LRU)",
    "verbosity": "a hint to OpenAI's own models; open models' chat templates read no such variable",
    "length_penalty": "vLLM's beam-search length penalty: beam search is refused here, and vLLM ignores it without",
    "spaces_between_special_tokens": "vLLM's spacing of adjacent special tokens in text decoded with "
    "skip_special_tokens=false; here special tokens decode as the tokenizer's own decoder joins them",
    "mm_processor_kwargs": "options for a multimodal processor: this worker reads text only (media parts are refused)",
    "guided_decoding_backend": "this worker has one structured-output backend, xgrammar, for every constraint",
    "include_obfuscation": "OpenAI's stream padding against length side channels: these chunks carry none",
    "annotations": "url citations in a history message (a web-search answer's): not text the template renders",
}
_warned: set[str] = set()


def warn_ignored(req: BaseModel, where: str) -> None:
    """Log, once per field for the process, that a request set a field in IGNORED_FIELDS."""
    for f in sorted(req.model_fields_set & IGNORED_FIELDS.keys() - _warned):
        if getattr(req, f) not in (None, type(req).model_fields[f].default):
            _warned.add(f)
            log.warning("%s.%s is accepted and ignored: %s", where, f, IGNORED_FIELDS[f])


class JobError(Exception):
    """A job's error in OpenAI's fields (openai_compat.error). `param`: the offending field's dotted path in the
    job's input (an OpenAI job's errors are rebased() onto its body); `code`: a string or None; `status`: the HTTP
    status a front answers with (default: by type, openai_compat.STATUS)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        status: int | None = None,
    ):
        super().__init__(message)
        if isinstance(code, int):  # the old signature took the HTTP status as `code`: a code is never a number
            status, code = status or code, None
        self.message, self.param, self.type, self.code = message, param, type, code
        self.status = status or STATUS.get(type, 500)

    def to_dict(self) -> dict:
        """The job's error object: OpenAI's four fields plus "status" (the emulator answers with it, then drops it)."""
        body = error(self.message, self.type, self.param, self.code)
        body["error"]["status"] = self.status
        return body

    def rebased(self, root: str, path: Callable[[str], str] = lambda p: p) -> JobError:
        """This error with the paths under `root` (the job field its request sits in) made the client's own:
        "root.a.b" becomes path("a.b") in param and message; `root` alone becomes "the request body" (param None)."""

        def own(p: str) -> str | None:
            return path(p[len(root) + 1 :]) if p.startswith(root + ".") else None if p == root else p

        message = re.sub(rf"\b{re.escape(root)}(?:\.[\w-]+)*", lambda m: own(m[0]) or "the request body", self.message)
        return JobError(message, self.param and own(self.param), self.type, self.code, self.status)


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
        raised = (err.get("ctx") or {}).get("error")
        if isinstance(raised, ValueError):  # our validators' own words (not pydantic's "Value error, ..." prefix)
            path, err["msg"] = path + list(getattr(raised, "path", ())), str(raised)
        loc = ".".join(str(p) for p in ([where] if where else []) + path)
        unknown = err["type"] == "extra_forbidden"
        code = "unknown_parameter" if unknown else None  # OpenAI's code for a field it does not know
        raise JobError(f"{loc}: {'unknown field' if unknown else err['msg']}", param=loc or None, code=code) from None


def _token_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(_Strict):
    """A chat message of any role in OpenAI's schema, with every field of each role (null: absent) and vLLM's
    reasoning fields, so a previous response's message.model_dump() is history as it is. handler/messages.py checks
    the parts and calls and readies the message for the chat template."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Any] | None = None  # text, or content parts (text; refusal in assistant messages)
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    refusal: str | None = None  # an assistant's refusal: its text for the template when it has no content
    function_call: dict[str, Any] | None = None  # the deprecated functions API's call: rendered as a tool call
    audio: dict[str, Any] | None = None  # a previous audio answer: refused (no audio here)
    annotations: list[Any] | None = None  # a response message's url citations: IGNORED_FIELDS
    reasoning_content: str | None = None  # vLLM's: an assistant's reasoning, for templates that render it
    reasoning: str | None = None  # vLLM's newer name for it

    @field_validator("content", "tool_calls", "function_call", "audio")
    @classmethod
    def _history(cls, v, info):  # content parts, tool calls, a function call; audio is refused
        return v if v is None else check_field(info.field_name, v, info.data.get("role"))

    @model_validator(mode="after")
    def _content_needed(self):
        # an assistant turn may be content-less (null with tool calls, a function_call or a refusal), and a
        # function result may be null (OpenAI's schema); the rest need content
        if self.content is None and self.role not in ("assistant", "function"):
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
    logit_bias: dict[int | str, float] | None = None  # as on the OpenAI routes


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
    include_obfuscation: bool | None = None  # OpenAI's: IGNORED_FIELDS


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
    # token id (JSON: a string) -> bias; SamplingParams parses the keys and clamps to [-100, 100] as vLLM does
    logit_bias: dict[int | str, float] | None = None
    # OpenAI bookkeeping fields that do not change generation
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's extra parameters (vllm/entrypoints/openai/*/protocol.py). Honoured:
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k >= 1 tokens (-1: all that fit)
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>"
    return_token_ids: bool | None = None  # token ids beside the text: each choice's token_ids, prompt_token_ids
    cache_salt: str | None = None  # honoured with the prefix cache off; refused while it is shared (openai_jobs)
    # ... accepted and ignored (IGNORED_FIELDS)
    request_id: str | None = None
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    guided_decoding_backend: str | None = None
    # ... refused when set to ask for something (unservable.REFUSED says what cannot be done)
    use_beam_search: bool = False
    allowed_token_ids: list[int] | None = None
    priority: int = 0
    logits_processors: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    max_repetition_pattern_size: int = 0
    min_repetition_pattern_size: int = 0
    repetition_min_count: int = 0
    guided_whitespace_pattern: str | None = None
    structural_tag: str | dict[str, Any] | None = None

    @field_validator(*unservable.REFUSED, check_fields=False)
    @classmethod
    def _refused(cls, v, info):
        return unservable.check(info.field_name, v)

    @field_validator("prompt_logprobs", check_fields=False)  # both routes have it
    @classmethod
    def _prompt_logprobs_whole(cls, v, info):
        if v is not None and info.data.get("stream"):  # as vLLM: only a whole response carries them
            raise ValueError("prompt_logprobs is not available with stream: true")
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
    # OpenAI's: honoured (a chat template variable, as in vLLM)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # ... refused when they ask for something (unservable.REFUSED)
    audio: dict[str, Any] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # ... accepted and ignored (IGNORED_FIELDS)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # vLLM's chat extras. Honoured:
    echo: bool = False  # the reply starts with the last message's text when it has the reply's role
    continue_final_message: bool = False  # the reply continues the last message (needs add_generation_prompt false)
    add_special_tokens: bool = False  # the tokenizer's own special tokens (BOS) on top of the template's
    documents: list[dict[str, Any]] | None = None  # for RAG templates
    chat_template: str | None = None  # this request's template (or the name of one of the model's)
    # ... refused when they ask for something, or ignored
    include_reasoning: bool = True
    bad_words: list[str] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_generate(cls, v, info):
        if v and info.data.get("add_generation_prompt"):  # as vLLM
            raise ValueError("continue_final_message needs add_generation_prompt: false (it continues the message)")
        return v


class CompletionRequest(_OpenAIBase):
    # OpenAI's four forms: a string, a list of strings, a list of token ids, a list of token-id lists; a list of
    # prompts is a batch, each its own engine request (handler/openai_completions.py)
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's and vLLM's default for completions; 0 (with echo only) scores the prompt and generates nothing
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's completion extras: honoured (add_special_tokens: the tokenizer's BOS etc.; prompt_logprobs: per choice)
    add_special_tokens: bool = True
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_embeds: str | list[str] | None = None  # unservable.REFUSED

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, v):
        """Say what is wrong with a prompt before pydantic's union does (its first message is "Input should be a
        valid string", whatever the form tried); an empty prompt anywhere is refused, as vLLM does."""
        forms = "a string, a list of strings, a list of token ids or a list of token-id lists"
        if isinstance(v, str):
            if not v:
                raise ValueError("prompt is empty")
            return v
        if not isinstance(v, list):
            raise ValueError(f"prompt must be {forms}, not {type(v).__name__}")
        if not v:
            raise ValueError(f"prompt is an empty list; it must be {forms}")
        kinds = {
            "id" if _token_id(p) else "str" if isinstance(p, str) else "ids" if isinstance(p, list) else "?" for p in v
        }
        if len(kinds) > 1 or "?" in kinds:
            raise ValueError(f"prompt must be {forms}; this list mixes kinds or holds something else")
        for i, p in enumerate(v):
            if isinstance(p, (str, list)) and not p:
                raise ValueError(f"prompt[{i}] is empty")
            if isinstance(p, list) and not all(_token_id(t) for t in p):
                raise ValueError(f"prompt[{i}] must be a list of token ids (integers)")
        return v

    @field_validator("suffix", "best_of")
    @classmethod
    def _unsupported(cls, v, info):
        if v and not (info.field_name == "best_of" and v == 1):
            raise ValueError(f"{info.field_name} is not supported")
        return v
