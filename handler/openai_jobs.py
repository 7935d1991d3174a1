"""OpenAI jobs (input {"openai_route", "openai_input"}): /v1/chat/completions, /v1/completions and /v1/models, whole
or streamed as SSE events. The response shapes are in openai_compat.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from engine import InvalidRequestError, LoRARequest
from handler import openai_compat as oa
from handler import openai_completions as completions
from handler import openai_extras as extras
from handler import tool_calls
from handler.guided import FIELDS as GUIDED_FIELDS
from handler.guided import structured_params
from handler.pacing import BatchSizer
from handler.schemas import ChatCompletionRequest, CompletionRequest, JobError, parse, sampling_params, warn_ignored

if TYPE_CHECKING:
    from handler.worker import Worker

CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
# request fields that map one to one onto SamplingParams
_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
)


async def openai_job(
    w: Worker, inp: dict, rid: str, lora: LoRARequest | None = None, sizer: BatchSizer | None = None
) -> AsyncIterator[Any]:
    """sizer: a native job's own stream batch sizes (use_openai_format); default: the worker's settings."""
    route = inp.get("openai_route")
    body = inp.get("openai_input") or {}
    if route == MODELS:  # the base model, then the adapters configured or used so far
        yield oa.models_list([w.served_name] + w.engine.lora_names())
        return
    tool_mode = tool_name = tool_grammar = max_calls = prompt_top = None
    chat_echo = ""  # vLLM's chat echo: the text the reply starts with
    if route == CHAT:
        req = parse(ChatCompletionRequest, body, "openai_input")
        parallel = req.parallel_tool_calls is not False
        tool_mode, tool_name, tool_grammar = tool_calls.plan(req.tools, req.tool_choice, w.settings, parallel=parallel)
        max_calls, prompt_top = None if parallel else 1, req.prompt_logprobs
        max_tokens = req.max_completion_tokens or req.max_tokens
        prompt, chat_echo = await extras.chat_prompt(w, req, max_tokens)  # {"prompt_token_ids"}: handler/openai_extras
        shapes = oa.ChatShapes(w.served_name, *_shape_args(w, req))
        top_n = req.top_logprobs or 0 if req.logprobs else None
    elif route == COMPLETIONS:
        req = parse(CompletionRequest, body, "openai_input")
        completions.check(req)
        shapes, max_tokens, top_n = (
            oa.CompletionShapes(w.served_name, *_shape_args(w, req)),
            req.max_tokens,
            req.logprobs,
        )
        # echo with logprobs: the prompt's own logprobs too (lm-eval-harness's loglikelihood requests); vLLM's
        # prompt_logprobs: each choice carries them
        asked = (req.prompt_logprobs, top_n if req.echo else None)
        prompt_top = max((k for k in asked if k is not None), default=None)
    else:
        fields, status = oa.route_error(str(route))  # names it and lists the routes (oa.ROUTES)
        raise JobError(**fields, status=status)
    warn_ignored(req, "openai_input")
    extras.warn_nested(req)
    extras.check_cache_salt(w, req)
    lora = _adapter(w, req.model) or lora
    structured = structured_params({f: getattr(req, f) for f in GUIDED_FIELDS}, "openai_input")
    if tool_grammar is not None:
        if structured is not None:
            raise JobError("tool_choice and a structured-output field cannot both constrain", param=structured.field)
        structured = tool_grammar
    params = sampling_params(
        {
            **{f: getattr(req, f) for f in _SAMPLING_FIELDS},
            "logprobs": top_n,
            "max_tokens": max_tokens or 1,
            "structured_outputs": structured,
            "prompt_logprobs": prompt_top,
        },
        "openai_input",
    )
    if route == COMPLETIONS:  # a prompt or a batch: one engine request per prompt (handler/openai_completions.py)
        async for chunk in completions.job(w, req, params, rid, lora, shapes, sizer):
            yield chunk
        return
    # the chat route from here on
    prompt, params = w.fit(
        prompt, params, "openai_input.max_tokens", default_room=not max_tokens, prompt_param="openai_input.messages"
    )
    cold: list = []
    gen = w.generate(prompt, params, rid, lora, cold)
    tools = (tool_mode, tool_name, max_calls) if tool_mode else None
    if req.stream:
        async for chunk in _stream(w, gen, shapes, req, top_n, tools, sizer, prompt, chat_echo):
            yield chunk
        return
    n_in, n_out, choices, cached, prompt_lps = 0, 0, [], 0, None
    async for out in gen:
        n_in = len(out.prompt_token_ids)
        if out.finished:
            prompt_lps = out.prompt_logprobs
            cached = out.metrics.cached_prompt_tokens
            for c in out.outputs:
                n_out += len(c.token_ids)
                text, lp = c.text, None
                if top_n is not None and c.logprobs:
                    lp = oa.chat_logprobs(extras.token_names(w, req), c.token_ids, c.logprobs, top_n)
                choice = {"index": c.index, "text": text, "finish_reason": c.finish_reason, "logprobs": lp}
                if tools:  # the whole text through the same parser a stream uses
                    st = tool_calls.ToolCallStream(*tools)
                    st.feed(c.text)
                    st.pending_content()
                    choice["text"], choice["tool_calls"] = st.message()
                    # "length": cut off, whatever was parsed (a call may be partial), as OpenAI reports it
                    ended = choice["tool_calls"] and c.finish_reason != "length"
                    choice["finish_reason"] = "tool_calls" if ended else c.finish_reason
                if chat_echo:
                    choice["text"] = chat_echo + (choice["text"] or "")
                choices.append(choice | {"token_ids": c.token_ids})
    full = shapes.full(choices, oa.usage(n_in, n_out, cached))
    if req.return_token_ids:  # vLLM's: the token ids beside the text
        full["prompt_token_ids"] = prompt["prompt_token_ids"]
        for shaped, choice in zip(full["choices"], choices):
            shaped["token_ids"] = choice["token_ids"]
    if req.prompt_logprobs is not None:  # vLLM's chat extra, at the top level; {token id: logprob}
        full["prompt_logprobs"] = prompt_lps
    if cold:
        full["metrics"] = {"cold_start": cold[0]}  # an extension field; OpenAI clients ignore it
    yield full


def _shape_args(w: Worker, req) -> tuple[str, bool]:
    """The response shapes' system_fingerprint (this deployment's model, revision, dtype, quantization and worker
    version) and whether a stream's chunks carry "usage": null before the usage chunk (include_usage)."""
    s = w.settings
    fingerprint = oa.system_fingerprint(s.MODEL_NAME or "default", s.MODEL_REVISION, s.DTYPE, s.QUANTIZATION)
    return fingerprint, bool(req.stream and req.stream_options and req.stream_options.include_usage)


def _adapter(w: Worker, model: str | None) -> LoRARequest | None:
    """vLLM's multi-LoRA serving: a `model` other than the served name names an adapter."""
    if model is None or model == w.served_name:
        return None
    if not w.settings.ENABLE_LORA:
        raise JobError(
            f"model {model!r} is not served here; use {w.served_name!r}",
            param="model",
            type="not_found_error",
            code="model_not_found",  # OpenAI's code
        )
    lora = LoRARequest(model)
    try:
        w.engine.resolve_lora(lora)
    except InvalidRequestError as e:
        raise JobError(f"model {model!r}: {e}", param="model", type="not_found_error", code="model_not_found") from None
    return lora


async def _stream(
    w: Worker, gen, shapes, req, top_n, tools=None, sizer=None, prompt=None, chat_echo=""
) -> AsyncIterator[str]:
    """A chat completion as SSE events (completions stream in handler/openai_completions.py)."""
    s = w.settings
    sizer = sizer or BatchSizer(s.DEFAULT_MIN_BATCH_SIZE, s.DEFAULT_BATCH_SIZE_GROWTH_FACTOR, s.DEFAULT_BATCH_SIZE)
    events, n_out, cached, parsers = [], 0, 0, {}
    n_in = len(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else 0
    each_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    ids_due, names = extras.TokenIdsDue(bool(req.return_token_ids)), extras.token_names(w, req)

    def event(obj: dict) -> str:  # continuous_usage_stats: vLLM's running usage on every chunk
        obj = ids_due.attach(obj)
        return oa.sse(obj | {"usage": oa.usage(n_in, n_out, cached)} if each_usage else obj)

    heads = [shapes.chunk(i, {"role": "assistant", "content": ""}) for i in range(req.n)]
    if req.return_token_ids:  # vLLM's: the prompt's ids in the first chunk
        heads[0]["prompt_token_ids"] = prompt["prompt_token_ids"]
    events += [event(h) for h in heads]
    events += [event(shapes.chunk(i, {"content": chat_echo})) for i in range(req.n) if chat_echo]
    async for group in w.paced(gen, sizer):
        for out in group:
            n_in = len(out.prompt_token_ids)
            if out.finished:
                cached = out.metrics.cached_prompt_tokens
            for c in out.outputs:
                n_out += len(c.delta_token_ids)
                ids_due.add(c.index, c.delta_token_ids)
                if not (c.delta_text or c.finish_reason or c.delta_token_ids):
                    continue
                lp, text = None, c.delta_text
                if top_n is not None and c.delta_token_ids and c.logprobs:
                    lp = oa.chat_logprobs(names, c.delta_token_ids, c.logprobs[-len(c.delta_token_ids) :], top_n)
                finish = c.finish_reason
                if tools:  # content and tool-call deltas in OpenAI's chunk shapes
                    st = parsers.setdefault(c.index, tool_calls.ToolCallStream(*tools))
                    text, calls = st.feed(text)
                    text += st.pending_content() if finish else ""
                    events += [event(shapes.chunk(c.index, {"tool_calls": [d]})) for d in calls]
                    finish = "tool_calls" if finish and finish != "length" and st.calls else finish
                if text or lp is not None:
                    events.append(event(shapes.chunk(c.index, {"content": text}, None, lp)))
                if finish:
                    events.append(event(shapes.chunk(c.index, {}, finish)))
        if events and not group[-1].finished:
            yield "".join(events)
            events = []
    yield oa.stream_end(events, shapes, req, oa.usage(n_in, n_out, cached))
