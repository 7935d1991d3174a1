"""OpenAI jobs (input {"openai_route", "openai_input"}): /v1/chat/completions, /v1/completions and /v1/models, whole
or streamed as SSE events. The response shapes are in openai_compat.py."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from engine import InvalidRequestError, LoRARequest
from handler import openai_compat as oa
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
    if route == CHAT:
        req = parse(ChatCompletionRequest, body, "openai_input")
        parallel = req.parallel_tool_calls is not False
        tool_mode, tool_name, tool_grammar = tool_calls.plan(req.tools, req.tool_choice, w.settings, parallel=parallel)
        max_calls, prompt_top = None if parallel else 1, req.prompt_logprobs
        template = w.settings.CUSTOM_CHAT_TEMPLATE or w.engine.tok.chat_template
        messages = tool_calls.history(
            [m.model_dump(exclude_none=True) for m in req.messages], w.settings.TOOL_CALL_PARSER, str(template or "")
        )
        prompt = await w.chat_prompt(
            messages, "openai_input.messages", req.add_generation_prompt, req.chat_template_kwargs, req.tools
        )
        shapes, max_tokens = oa.ChatShapes(w.served_name), req.max_completion_tokens or req.max_tokens
        top_n = req.top_logprobs or 0 if req.logprobs else None
    elif route == COMPLETIONS:
        req = parse(CompletionRequest, body, "openai_input")
        prompt = {"prompt_token_ids": req.prompt} if isinstance(req.prompt, list) else req.prompt
        shapes, max_tokens, top_n = oa.CompletionShapes(w.served_name), req.max_tokens, req.logprobs
        # echo with logprobs: the prompt's own logprobs too (lm-eval-harness's loglikelihood requests)
        prompt_top = top_n if req.echo else None
    else:
        raise JobError(
            f"openai_route {route!r} is not one of {CHAT}, {COMPLETIONS}, {MODELS}",
            param="openai_route",
            type="not_found_error",
            code=404,
        )
    warn_ignored(req, "openai_input")
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
    echo = route == COMPLETIONS and req.echo
    prompt, params = w.fit(
        prompt,
        params,
        "openai_input.max_tokens",
        default_room=not max_tokens,
        prompt_param="openai_input.messages" if route == CHAT else "openai_input.prompt",
    )
    chat = route == CHAT
    cold: list = []
    gen = w.generate(prompt, params, rid, lora, cold)
    tools = (tool_mode, tool_name, max_calls) if tool_mode else None
    if req.stream:
        async for chunk in _stream(w, gen, shapes, req, chat, top_n, echo, tools, sizer, prompt):
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
                text, lp = _echoed(w, out, c, top_n) if echo else (c.text, None)
                if top_n is not None and c.logprobs and not echo:
                    lp = _logprobs(w, chat, c.token_ids, c.logprobs, top_n)
                choice = {"index": c.index, "text": text, "finish_reason": c.finish_reason, "logprobs": lp}
                if tools:  # the whole text through the same parser a stream uses
                    st = tool_calls.ToolCallStream(*tools)
                    st.feed(c.text)
                    st.pending_content()
                    choice["text"], choice["tool_calls"] = st.message()
                    choice["finish_reason"] = "tool_calls" if choice["tool_calls"] else c.finish_reason
                choices.append(choice)
    full = shapes.full(choices, oa.usage(n_in, n_out, cached))
    if chat and req.prompt_logprobs is not None:  # vLLM's chat extra, at the top level; {token id: logprob}
        full["prompt_logprobs"] = prompt_lps
    if cold:
        full["metrics"] = {"cold_start": cold[0]}  # an extension field; OpenAI clients ignore it
    yield full


def _adapter(w: Worker, model: str | None) -> LoRARequest | None:
    """vLLM's multi-LoRA serving: a `model` other than the served name names an adapter."""
    if model is None or model == w.served_name:
        return None
    if not w.settings.ENABLE_LORA:
        raise JobError(
            f"model {model!r} is not served here; use {w.served_name!r}",
            param="model",
            type="not_found_error",
            code=404,
        )
    lora = LoRARequest(model)
    try:
        w.engine.resolve_lora(lora)
    except InvalidRequestError as e:
        raise JobError(f"model {model!r}: {e}", param="model", type="not_found_error", code=404) from None
    return lora


def _echoed(w: Worker, out, c, top_n: int | None) -> tuple[str, dict | None]:
    """/v1/completions with echo: the prompt's text before the completion's, and with logprobs the prompt's tokens
    first (the first one's logprob null), as OpenAI's legacy API and vLLM give them."""
    tok, ids = w.engine.tok, out.prompt_token_ids
    prompt_text = tok.decode(ids, skip_special_tokens=False)
    if top_n is None:
        return prompt_text + c.text, None
    lps = list(out.prompt_logprobs or [None] * len(ids)) + list(c.logprobs or [])
    return prompt_text + c.text, oa.completion_logprobs(tok, ids + c.token_ids, lps, top_n)


def _logprobs(w: Worker, chat: bool, token_ids: list[int], lps: list[dict], top_n: int) -> dict:
    """OpenAI's logprobs object for these tokens (chat or completions shape)."""
    return (oa.chat_logprobs if chat else oa.completion_logprobs)(w.engine.tok, token_ids, lps, top_n)


async def _stream(
    w: Worker, gen, shapes, req, chat: bool, top_n, echo=False, tools=None, sizer=None, prompt=None
) -> AsyncIterator[str]:
    s = w.settings
    sizer = sizer or BatchSizer(s.DEFAULT_MIN_BATCH_SIZE, s.DEFAULT_BATCH_SIZE_GROWTH_FACTOR, s.DEFAULT_BATCH_SIZE)
    events, n_out, cached, echoed, parsers = [], 0, 0, set(), {}
    n_in = len(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else 0
    each_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def event(obj: dict) -> str:  # continuous_usage_stats: vLLM's running usage on every chunk
        return oa.sse(obj | {"usage": oa.usage(n_in, n_out, cached)} if each_usage else obj)

    if chat:
        events += [event(shapes.chunk(i, {"role": "assistant", "content": ""})) for i in range(req.n)]
    async for group in w.paced(gen, sizer):
        for out in group:
            n_in = len(out.prompt_token_ids)
            if out.finished:
                cached = out.metrics.cached_prompt_tokens
            for c in out.outputs:
                n_out += len(c.delta_token_ids)
                if not (c.delta_text or c.finish_reason or c.delta_token_ids):
                    continue
                lp, text = None, c.delta_text
                if top_n is not None and c.delta_token_ids and c.logprobs:
                    lp = _logprobs(w, chat, c.delta_token_ids, c.logprobs[-len(c.delta_token_ids) :], top_n)
                if echo and c.index not in echoed:  # the prompt goes out first, in the choice's first chunk
                    echoed.add(c.index)
                    first = dataclasses.replace(c, text="", token_ids=[], logprobs=[])
                    prompt_text, prompt_lp = _echoed(w, out, first, top_n)
                    text = prompt_text + text
                    if prompt_lp is not None and lp is not None:
                        lp = {k: prompt_lp[k] + lp[k] for k in lp}
                    lp = lp or prompt_lp
                finish = c.finish_reason
                if tools:  # content and tool-call deltas in OpenAI's chunk shapes
                    st = parsers.setdefault(c.index, tool_calls.ToolCallStream(*tools))
                    text, calls = st.feed(text)
                    text += st.pending_content() if finish else ""
                    events += [event(shapes.chunk(c.index, {"tool_calls": [d]})) for d in calls]
                    finish = "tool_calls" if finish and st.calls else finish
                if text or lp is not None:
                    events.append(event(shapes.chunk(c.index, {"content": text}, None, lp)))
                if finish:
                    events.append(event(shapes.chunk(c.index, {}, finish)))
        if events and not group[-1].finished:
            yield "".join(events)
            events = []
    if req.stream_options and req.stream_options.include_usage:
        events.append(oa.sse(shapes.usage_chunk(oa.usage(n_in, n_out, cached))))
    events.append(oa.SSE_DONE)
    yield "".join(events)
