"""Fields of OpenAI's and vLLM's request schemas that ask for what this worker cannot do.

Each is accepted when absent, null or at its no-op value (a client that sends a default is never refused), and
otherwise refused with a 400 that names the field and says what cannot be done. schemas._OpenAIBase checks every
field named here (`check`); the rest of the classification (honoured, ignored) is in schemas.py and docs/api.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_TEXT_ONLY = "this worker generates text only"

# field -> (does this value ask for something?, what cannot be done and what to send instead)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # OpenAI's chat completions
    "audio": (lambda v: True, f"audio output is not available: {_TEXT_ONLY}"),
    "modalities": (lambda v: "audio" in v, f"the audio modality is not available: {_TEXT_ONLY}; send ['text']"),
    "functions": (
        bool,
        "the deprecated functions API is not supported: send them as tools ([{'type': 'function', 'function': "
        "{...}}]) and function_call as tool_choice",
    ),
    "function_call": (
        lambda v: v not in ("none", "auto"),  # with no functions (refused above) both mean a plain answer
        "the deprecated functions API is not supported: name the function in tool_choice ({'type': 'function', "
        "'function': {'name': ...}}) with it in tools",
    ),
    "moderation": (lambda v: True, "moderation is not available: this worker runs no moderation model"),
    "prediction": (
        lambda v: True,
        "Predicted Outputs are not supported: this worker cannot decode from a predicted text; send the request "
        "without prediction",
    ),
    "web_search_options": (lambda v: True, "web search is not available: this worker has no search tool"),
    # vLLM's extra parameters
    "include_reasoning": (
        lambda v: v is False,
        "include_reasoning=false needs a reasoning parser to take the reasoning out of the content; this worker has "
        "none",
    ),
    "use_beam_search": (bool, "beam search is not available on this worker; sample n choices, or use temperature 0"),
    "allowed_token_ids": (
        bool,
        "allowed_token_ids is not supported: this worker cannot restrict sampling to a token list; use "
        "structured_outputs (choice, regex) or logit_bias",
    ),
    "bad_words": (bool, "bad_words is not supported: this worker cannot ban word sequences; use logit_bias or stop"),
    "priority": (
        lambda v: v != 0,
        "priority scheduling is not available: this worker serves requests first come, first served (vLLM refuses a "
        "priority other than 0 in that mode too)",
    ),
    "logits_processors": (bool, "custom logits processors are not supported: this worker loads no request code"),
    "kv_transfer_params": (bool, "KV transfer (disaggregated prefill) is not available on this worker"),
    "vllm_xargs": (bool, "vllm_xargs are read by custom vLLM extensions; this worker has none"),
    "max_repetition_pattern_size": (bool, "stopping on repeated token patterns is not supported on this worker"),
    "min_repetition_pattern_size": (bool, "stopping on repeated token patterns is not supported on this worker"),
    "repetition_min_count": (bool, "stopping on repeated token patterns is not supported on this worker"),
    "guided_whitespace_pattern": (
        lambda v: True,
        "a whitespace pattern for JSON is not supported: xgrammar's JSON grammar has no such option",
    ),
    "structural_tag": (
        lambda v: True,
        "structural tags are not supported; use structured_outputs (json, regex, choice, grammar) or tools",
    ),
    "prompt_embeds": (lambda v: True, "prompt embeddings are not accepted: send the prompt as text or token ids"),
}


def check(field: str, value: Any) -> Any:
    """`value` unless it asks for what `field` cannot give here (then ValueError saying so)."""
    asks, why = REFUSED[field]
    if value is not None and asks(value):
        raise ValueError(why)
    return value
