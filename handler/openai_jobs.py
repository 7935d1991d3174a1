"""OpenAI jobs (input {"openai_route", "openai_input"}): /v1/chat/completions, /v1/completions and /v1/models, whole
or streamed as SSE events. The response shapes are in openai_compat.py; /v1/completions after validation is
openai_completions.py."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine import LoRARequest
from handler import anthropic_messages as anthropic
from handler import harmony, jobs, reasoning, tool_calls
from handler import openai_compat as oa
from handler import openai_completions as completions
from handler import openai_embeddings as embeddings
from handler import openai_extras as extras
from handler import openai_responses as responses
from handler import openai_tokenize as tokens
from handler.guided import FIELDS as GUIDED_FIELDS
from handler.guided import structured_params
from handler.jobs import JobContext
from handler.pacing import BatchSizer
from handler.schemas import ChatCompletionRequest, CompletionRequest, JobError, parse, sampling_params, warn_ignored

CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
WHERE = "openai_input"  # the job field the request body sits in (errors name paths under it)
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
    ctx: JobContext, inp: dict, rid: str, lora: LoRARequest | None = None, sizer: BatchSizer | None = None
) -> AsyncIterator[Any]:
    """lora, sizer: a native job's adapter and stream batch sizes (use_openai_format); by default the adapter is
    the one `model` names and the sizes are the worker's settings."""
    route = inp.get("openai_route")
    body = inp.get("openai_input") or {}
    sizer = sizer or jobs.sizer(ctx)
    if route == MODELS:  # the base model, then the adapters configured or used so far
        yield oa.models_list([ctx.served_name] + ctx.engine.lora_names())
    elif route == CHAT:
        async for chunk in _chat(ctx, parse(ChatCompletionRequest, body, WHERE), rid, lora, sizer):
            yield chunk
    elif route == COMPLETIONS:
        async for chunk in _completions(ctx, parse(CompletionRequest, body, WHERE), rid, sizer):
            yield chunk
    elif route == responses.RESPONSES:
        async for chunk in _responses(ctx, body, rid, sizer):
            yield chunk
    elif route in (anthropic.MESSAGES, anthropic.COUNT_TOKENS):
        async for chunk in _anthropic(ctx, route, body, rid, sizer):
            yield chunk
    elif route == embeddings.EMBEDDINGS:
        yield await embeddings.embeddings(ctx, body, rid, WHERE)
    elif route == tokens.TOKENIZE:
        yield await tokens.tokenize(ctx, body, WHERE)
    elif route == tokens.DETOKENIZE:
        yield tokens.detokenize(ctx, body, WHERE)
    else:
        fields, status = oa.route_error(str(route))  # names it and lists the routes (oa.ROUTES)
        raise JobError(**fields, status=status)


async def _anthropic(ctx: JobContext, route: str, body: Any, rid: str, sizer: BatchSizer):
    """Anthropic's Messages API through the chat route (handler/anthropic_messages.py)."""
    req = anthropic.parse_request(body, route)
    chat = anthropic.chat_body(req)
    if route == anthropic.COUNT_TOKENS:
        keep = ("model", "messages", "tools", "chat_template_kwargs")
        yield {"input_tokens": (await tokens.tokenize(ctx, {k: chat[k] for k in keep if k in chat}, WHERE))["count"]}
        return
    replies = _chat(ctx, parse(ChatCompletionRequest, chat, WHERE), rid, None, sizer)
    if req.stream:
        async for event in anthropic.events(replies, req.model):
            yield event
    else:
        async for whole in replies:
            yield anthropic.message(whole)


async def _responses(ctx: JobContext, body: Any, rid: str, sizer: BatchSizer):
    """OpenAI's Responses API through the chat route (handler/openai_responses.py)."""
    req, items = responses.parse_request(body, WHERE)
    replies = _chat(ctx, parse(ChatCompletionRequest, responses.chat_body(req, items), WHERE), rid, None, sizer)
    if req.stream:
        async for event in responses.events(req, items, req.model or ctx.served_name, replies):
            yield event
    else:
        async for whole in replies:
            yield responses.whole(req, items, whole)


@dataclass(frozen=True)
class _Reply:
    """How a chat request's reply is shaped, whole or streamed."""

    req: ChatCompletionRequest
    shapes: oa.ChatShapes
    top_n: int | None  # top_logprobs per token (None: no logprobs)
    tools: tuple | None  # tool_calls.ToolCallStream's arguments, when the reply may call tools
    echo: str  # vLLM's chat echo: the text the reply starts with ("" without echo)
    prompt_token_ids: list[int]
    in_content: bool | None = None  # REASONING_PARSER set: whether the reply starts with its answer (reasoning.py)
    harmony: Any = None  # GPT-OSS: the harmony encoding its replies are parsed with, from their ids (harmony.py)

    def reasoning(self) -> reasoning.ReasoningStream | harmony.HarmonyStream | None:
        if self.harmony is not None:
            return harmony.HarmonyStream(self.harmony)
        return None if self.in_content is None else reasoning.ReasoningStream(self.in_content)

    @property
    def splits(self) -> bool:  # the reply's reasoning comes apart from its answer
        return self.in_content is not None or self.harmony is not None


async def _chat(ctx: JobContext, req: ChatCompletionRequest, rid: str, lora, sizer: BatchSizer):
    parallel = req.parallel_tool_calls is not False
    enc = harmony.for_model(ctx)  # GPT-OSS: reasoning and tool calls come in its harmony channels
    if enc is not None:
        tool_mode, tool_name, tool_grammar = harmony.tool_plan(req.tools, req.tool_choice, WHERE), None, None
    else:
        tool_mode, tool_name, tool_grammar = tool_calls.plan(req.tools, req.tool_choice, ctx.settings,
                                                             parallel=parallel)  # fmt: skip
    max_tokens = req.max_completion_tokens or req.max_tokens
    prompt, echo = await extras.chat_prompt(ctx, req, max_tokens)  # {"prompt_token_ids"}
    shapes = oa.ChatShapes(ctx.served_name, *_shape_args(ctx, req))
    top_n = req.top_logprobs or 0 if req.logprobs else None
    model_lora = _checked(ctx, req)
    in_content = after = None
    if (parser := ctx.settings.REASONING_PARSER) in reasoning.PARSERS and enc is None:
        tail = ctx.engine.tok.decode(prompt["prompt_token_ids"][-32:], skip_special_tokens=False)
        in_content = reasoning.starts_in_content(parser, tail, req.chat_template_kwargs)
        # a grammar (structured output, a forced tool call) constrains the answer, not the thinking (as vLLM)
        after = None if in_content else tuple(ctx.engine.tok.encode(reasoning.END, add_special_tokens=False))
    if enc is not None:  # a grammar constrains GPT-OSS's answer: what follows its final channel's header
        after = harmony.answer_start(enc)
    if tool_mode == "auto:mistral":  # its [TOOL_CALLS] is a special token: keep it in the text (as vLLM)
        req = req.model_copy(update={"skip_special_tokens": False})
    params = _params(req, top_n, max_tokens, req.prompt_logprobs, tool_grammar, after)
    where = jobs.Fields(f"{WHERE}.max_tokens", f"{WHERE}.messages", req.model if model_lora else None)
    valid = jobs.prepare(ctx, prompt, params, model_lora or lora, where, default_room=not max_tokens)
    outputs = jobs.generate(ctx, valid, rid)
    tools = (tool_mode, tool_name, None if parallel else 1, tool_calls.schemas(req.tools)) if tool_mode else None
    reply = _Reply(req, shapes, top_n, tools, echo, valid.prompt_token_ids, in_content, enc)
    if req.stream:
        async for chunk in _stream(ctx, outputs, reply, sizer):
            yield chunk
    else:
        yield await _whole(ctx, outputs, reply)


async def _completions(ctx: JobContext, req: CompletionRequest, rid: str, sizer: BatchSizer):
    completions.check(req)
    shapes = oa.CompletionShapes(ctx.served_name, *_shape_args(ctx, req))
    # echo with logprobs: the prompt's own logprobs too (lm-eval-harness's loglikelihood requests); vLLM's
    # prompt_logprobs: each choice carries them
    asked = (req.prompt_logprobs, req.logprobs if req.echo else None)
    prompt_top = max((k for k in asked if k is not None), default=None)
    lora = _checked(ctx, req)
    params = _params(req, req.logprobs, req.max_tokens, prompt_top)
    async for chunk in completions.job(ctx, req, params, rid, lora, shapes, sizer):  # one engine request a prompt
        yield chunk


def _checked(ctx: JobContext, req) -> LoRARequest | None:
    """What both routes check before their sampling parameters: ignored fields (logged), cache_salt, and `model`
    (vLLM's multi-LoRA serving: a name other than the served one names an adapter, which validation resolves)."""
    warn_ignored(req, WHERE)
    extras.warn_nested(req)
    extras.check_cache_salt(ctx, req)
    if req.model is None or req.model == ctx.served_name:
        return None
    if not ctx.settings.ENABLE_LORA:
        raise JobError(
            f"model {req.model!r} is not served here; use {ctx.served_name!r}",
            param="model",
            type="not_found_error",
            code="model_not_found",  # OpenAI's code
        )
    return LoRARequest(req.model)


def _params(req, top_n: int | None, max_tokens: int | None, prompt_top: int | None, tool_grammar=None, after=None):
    """The request's SamplingParams; tool_grammar: what tool_choice forces (it and a structured-output field
    cannot both constrain); after: the tokens the constraint starts after (the reasoning's end)."""
    structured = structured_params({f: getattr(req, f) for f in GUIDED_FIELDS}, WHERE)
    if tool_grammar is not None:
        if structured is not None:
            raise JobError("tool_choice and a structured-output field cannot both constrain", param=structured.field)
        structured = tool_grammar
    if structured is not None and after:
        structured = dataclasses.replace(structured, after=after)
    fields = {f: getattr(req, f) for f in _SAMPLING_FIELDS} | {"structured_outputs": structured}
    fields |= {"logprobs": top_n, "max_tokens": max_tokens or 1, "prompt_logprobs": prompt_top}
    return sampling_params(fields, WHERE)


def _shape_args(ctx: JobContext, req) -> tuple[str, bool]:
    """The response shapes' system_fingerprint (this deployment's model, revision, dtype, quantization and worker
    version) and whether a stream's chunks carry "usage": null before the usage chunk (include_usage)."""
    s = ctx.settings
    fingerprint = oa.system_fingerprint(s.MODEL_NAME or "default", s.MODEL_REVISION, s.DTYPE, s.QUANTIZATION)
    return fingerprint, bool(req.stream and req.stream_options and req.stream_options.include_usage)


async def _whole(ctx: JobContext, outputs, reply: _Reply) -> dict:
    """A chat completion in one response."""
    n_in, n_out, choices, cached, prompt_lps, thinking = 0, 0, [], 0, None, {}
    async for out in outputs:
        n_in = len(out.prompt_token_ids)
        for c in out.outputs if reply.splits else ():  # the reasoning's tokens, as they came
            st = thinking.setdefault(c.index, reply.reasoning())
            st.feed(c.delta_token_ids) if reply.harmony else st.feed(c.delta_text, len(c.delta_token_ids))
        if out.finished:
            prompt_lps, cached = out.prompt_logprobs, out.metrics.cached_prompt_tokens
            for c in out.outputs:
                n_out += len(c.token_ids)
                choices.append(_choice(ctx, reply, c, thinking.get(c.index)))
    req = reply.req
    full = reply.shapes.full(choices, _usage(reply, n_in, n_out, cached, thinking.values()))
    if req.return_token_ids:  # vLLM's: the token ids beside the text
        full["prompt_token_ids"] = reply.prompt_token_ids
        for shaped, choice in zip(full["choices"], choices):
            shaped["token_ids"] = choice["token_ids"]
    if req.prompt_logprobs is not None:  # vLLM's chat extra, at the top level; {token id: logprob}
        full["prompt_logprobs"] = prompt_lps
    if (cold := jobs.cold_start(ctx)) is not None:
        full["metrics"] = {"cold_start": cold}  # an extension field; OpenAI clients ignore it
    return full


def _usage(reply: _Reply, n_in: int, n_out: int, cached: int, thinking) -> dict:
    """OpenAI's usage; with a reasoning parser, how many of the completion tokens were reasoning (vLLM's)."""
    u = oa.usage(n_in, n_out, cached)
    if reply.splits:
        u["completion_tokens_details"] = {"reasoning_tokens": sum(t.reasoning_tokens for t in thinking)}
    return u


def _choice(ctx: JobContext, reply: _Reply, c, thinking: reasoning.ReasoningStream | None = None) -> dict:
    """One finished choice of a whole chat completion; `thinking`: its text split by the reasoning parser."""
    lp = None
    if reply.top_n is not None and c.logprobs:
        lp = oa.chat_logprobs(extras.token_names(ctx, reply.req), c.token_ids, c.logprobs, reply.top_n)
    text, why, calls = c.text, None, []
    if isinstance(thinking, harmony.HarmonyStream):
        thinking.finish()
        why, text, calls = thinking.message()
    elif thinking is not None:
        thinking.finish()
        why, text = thinking.split()  # vLLM's message fields: reasoning (and its old name), content
    choice = {"index": c.index, "text": text, "finish_reason": c.finish_reason, "logprobs": lp}
    if thinking is not None:
        choice["reasoning"] = why
    if reply.tools and reply.harmony is None:  # the answer through the same parser a stream uses
        st = tool_calls.ToolCallStream(*reply.tools)
        st.feed(text or "")
        st.pending_content()
        choice["text"], choice["tool_calls"] = st.message()
        calls = choice["tool_calls"]
    elif calls:  # GPT-OSS's, from its channels
        choice["tool_calls"] = calls
    if calls and c.finish_reason != "length":  # "length": cut off, whatever was parsed, as OpenAI reports it
        choice["finish_reason"] = "tool_calls"
    if reply.echo:
        choice["text"] = reply.echo + (choice["text"] or "")
    return choice | {"token_ids": c.token_ids}


async def _stream(ctx: JobContext, outputs, reply: _Reply, sizer: BatchSizer) -> AsyncIterator[str]:
    """A chat completion as SSE events (completions stream in handler/openai_completions.py)."""
    req, shapes = reply.req, reply.shapes
    events, n_out, cached, parsers, thinking = [], 0, 0, {}, {}
    n_in = len(reply.prompt_token_ids)
    each_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    ids_due, names = extras.TokenIdsDue(bool(req.return_token_ids)), extras.token_names(ctx, req)

    def event(obj: dict) -> str:  # continuous_usage_stats: vLLM's running usage on every chunk
        obj = ids_due.attach(obj)
        return oa.sse(obj | {"usage": _usage(reply, n_in, n_out, cached, thinking.values())} if each_usage else obj)

    heads = [shapes.chunk(i, {"role": "assistant", "content": ""}) for i in range(req.n)]
    if req.return_token_ids:  # vLLM's: the prompt's ids in the first chunk
        heads[0]["prompt_token_ids"] = reply.prompt_token_ids
    events += [event(h) for h in heads]
    events += [event(shapes.chunk(i, {"content": reply.echo})) for i in range(req.n) if reply.echo]
    async for group in jobs.paced(ctx, outputs, sizer):
        for out in group:
            n_in = len(out.prompt_token_ids)
            if out.finished:
                cached = out.metrics.cached_prompt_tokens
            for c in out.outputs:
                n_out += len(c.delta_token_ids)
                ids_due.add(c.index, c.delta_token_ids)
                if not (c.delta_text or c.finish_reason or c.delta_token_ids):
                    continue
                lp, text, finish, calls, called = None, c.delta_text, c.finish_reason, [], False
                if reply.splits:  # the reasoning apart: both of vLLM's names for it
                    st = thinking.setdefault(c.index, reply.reasoning())
                    if reply.harmony is not None:  # GPT-OSS: its channels, from the token ids
                        d = st.feed(c.delta_token_ids)
                        why, text, calls = d.reasoning, d.content + (st.finish() if finish else ""), d.calls
                        called = bool(st.calls)
                    else:
                        why, text = st.feed(text, len(c.delta_token_ids))
                        why += st.finish()[0] if finish else ""
                    if why:
                        events.append(event(shapes.chunk(c.index, {"reasoning": why, "reasoning_content": why})))
                if reply.top_n is not None and c.delta_token_ids and c.logprobs:
                    lp = oa.chat_logprobs(names, c.delta_token_ids, c.logprobs[-len(c.delta_token_ids) :], reply.top_n)
                if reply.tools and reply.harmony is None:  # content and tool-call deltas in OpenAI's chunk shapes
                    st = parsers.setdefault(c.index, tool_calls.ToolCallStream(*reply.tools))
                    text, calls = st.feed(text)
                    text += st.pending_content() if finish else ""
                    called = bool(st.calls)
                events += [event(shapes.chunk(c.index, {"tool_calls": [d]})) for d in calls]
                finish = "tool_calls" if finish and finish != "length" and called else finish
                if text or lp is not None:
                    events.append(event(shapes.chunk(c.index, {"content": text}, None, lp)))
                if finish:
                    events.append(event(shapes.chunk(c.index, {}, finish)))
        if events and not group[-1].finished:
            yield "".join(events)
            events = []
    yield oa.stream_end(events, shapes, req, _usage(reply, n_in, n_out, cached, thinking.values()))
