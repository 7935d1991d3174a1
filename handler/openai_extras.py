"""What a few OpenAI and vLLM request fields do around generation, for both OpenAI routes (openai_jobs.py,
openai_completions.py); docs/api.md has the table of every field.

- The chat prompt: the history readied for the template (messages.py) and its tool calls (tool_calls.history), the
  template variables (chat_template_kwargs, with reasoning_effort and documents over them), continue_final_message,
  and the request's own chat_template.
- A prompt's token ids: add_special_tokens (on chat false by default: the template writes the special tokens, as in
  vLLM), then truncate_prompt_tokens (the last k tokens; -1: as many as fit beside max_tokens).
- cache_salt: honoured by a prefix cache that is off; refused while one cache serves every request.
- In the response: return_tokens_as_token_ids (logprobs name tokens "token_id:<id>"), return_token_ids (token ids
  beside the text), and chat echo (the reply starts with the last message's text when that has the reply's role).
- The log lines of ignored fields inside a request's parts (a message's annotations, stream_options')."""

from __future__ import annotations

from typing import TYPE_CHECKING

from handler import harmony, jobs, messages, tool_calls
from handler.jobs import JobContext
from handler.schemas import JobError, warn_ignored

if TYPE_CHECKING:
    from handler.schemas import ChatCompletionRequest

WHERE = "openai_input"  # the job field an OpenAI request sits in


def warn_nested(req) -> None:
    """warn_ignored for the parts of a request that are models of their own."""
    for i, m in enumerate(getattr(req, "messages", None) or []):
        warn_ignored(m, f"{WHERE}.messages.{i}")
    if req.stream_options is not None:
        warn_ignored(req.stream_options, f"{WHERE}.stream_options")


def check_cache_salt(ctx: JobContext, req) -> None:
    """vLLM's cache_salt keeps other requests from hitting this one's cached prefix. Without a prefix cache nothing
    is shared, so it holds; with the shared cache this worker has no per-salt keys, so it is refused."""
    if req.cache_salt is None:
        return
    param = f"{WHERE}.cache_salt"
    if not req.cache_salt:
        raise JobError("cache_salt must be a non-empty string", param=param)
    if ctx.settings.ENABLE_PREFIX_CACHING:
        raise JobError(
            "cache_salt cannot be honoured: this worker's prefix cache is shared by all requests and has no per-salt "
            "keys (ENABLE_PREFIX_CACHING=true); send no cache_salt, or run it with ENABLE_PREFIX_CACHING=false",
            param=param,
        )


async def chat_prompt(ctx: JobContext, req: ChatCompletionRequest, max_tokens: int | None) -> tuple[dict, str]:
    """({"prompt_token_ids"}, the text `echo` puts before the reply: "" unless echo is set)."""
    if req.chat_template is not None and not ctx.settings.TRUST_REQUEST_CHAT_TEMPLATE:
        raise JobError(  # a template is code the client sends: vLLM too renders it only when told to trust it
            "a request's own chat_template is not accepted on this worker: set TRUST_REQUEST_CHAT_TEMPLATE=true "
            "(vLLM's --trust-request-chat-template) to allow it, or send none",
            param=f"{WHERE}.chat_template",
        )
    custom = req.chat_template or ctx.settings.CUSTOM_CHAT_TEMPLATE
    if custom is None and (enc := harmony.for_model(ctx)) is not None:  # GPT-OSS: openai-harmony renders it
        turns = [m.model_dump(exclude_none=True) for m in req.messages]
        ids = harmony.render_chat(enc, turns, req.tools, req.reasoning_effort, req.tool_choice)
        echo = messages.last_text(turns, "assistant") if req.echo else ""
        return prompt_ids(ctx, req, {"prompt_token_ids": ids}, f"{WHERE}.messages", max_tokens, always=True), echo
    template = messages.pick_template(ctx.engine.tok.chat_template, custom, req.tools)
    history = messages.for_template([m.model_dump(exclude_none=True) for m in req.messages], template)
    echo = messages.last_text(history, "assistant" if req.add_generation_prompt else history[-1]["role"])
    history = tool_calls.history(history, ctx.settings.TOOL_CALL_PARSER, template)
    kw = dict(req.chat_template_kwargs or {})  # vLLM's order: the request's own fields over chat_template_kwargs
    kw |= {k: v for k in ("reasoning_effort", "documents") if (v := getattr(req, k)) is not None}
    if req.continue_final_message:
        kw["continue_final_message"] = True
    text = await jobs.chat_prompt(
        ctx, history, f"{WHERE}.messages", req.add_generation_prompt, kw, req.tools, req.chat_template
    )
    return prompt_ids(ctx, req, text, f"{WHERE}.messages", max_tokens, always=True), echo if req.echo else ""


def prompt_ids(ctx: JobContext, req, prompt: str | dict, param: str, max_tokens: int | None, always: bool = False):
    """A prompt (text, or {"prompt_token_ids"}) under the request's add_special_tokens and truncate_prompt_tokens:
    {"prompt_token_ids"}, or the prompt as it is where neither changes it (and not `always`)."""
    k = req.truncate_prompt_tokens
    if isinstance(prompt, str):
        if not always and req.add_special_tokens and k is None:
            return prompt  # the engine tokenizes it as it always does
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone UTF-16 surrogate from a JSON escape: the Rust tokenizer refuses it
            raise JobError(f"{param}: not valid Unicode text: {e.reason} at character {e.start}", param=param) from None
        ids = ctx.engine.tok.encode(prompt, add_special_tokens=req.add_special_tokens)
    else:
        ids = list(prompt["prompt_token_ids"])  # token ids get no special tokens added (vLLM)
    if k is not None:
        keep = ctx.engine.max_model_len - (max_tokens or 1) if k == -1 else k
        if keep < 1:
            raise JobError(
                f"truncate_prompt_tokens={k} keeps no token: give k >= 1 (the prompt's last k tokens), or -1 (as many "
                f"as fit beside max_tokens in the context of {ctx.engine.max_model_len})",
                param=f"{WHERE}.truncate_prompt_tokens",
            )
        ids = ids[-keep:]  # vLLM truncates on the left: the end of the prompt is what the model continues
    return {"prompt_token_ids": ids}


class _TokenIds:
    """Stands in for the tokenizer where the logprobs shapes name tokens (openai_compat): "token_id:<id>", vLLM's
    return_tokens_as_token_ids, for clients that need tokens which are no valid text alone."""

    @staticmethod
    def decode(ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"token_id:{i}" for i in ids)


def token_names(ctx: JobContext, req):
    """What names the tokens of logprobs: the tokenizer, or token ids (return_tokens_as_token_ids)."""
    return _TokenIds() if req.return_tokens_as_token_ids else ctx.engine.tok


class TokenIdsDue:
    """return_token_ids on a stream: each choice's new token ids ride on that choice's next chunk (a step may emit
    no chunk for a choice, e.g. while a tool call is parsed; its ids then go with the next one); on /v1/completions
    its first chunk also carries the prompt's ids (vLLM's stream choice fields)."""

    def __init__(self, on: bool):
        self.on, self.due, self.seen = on, {}, set()

    def add(self, index: int, ids: list[int], prompt_ids: list[int] | None = None) -> None:
        if self.on:
            due = self.due.setdefault(index, {"token_ids": []})
            due["token_ids"] += ids
            if prompt_ids is not None and index not in self.seen:
                self.seen.add(index)
                due["prompt_token_ids"] = list(prompt_ids)

    def attach(self, chunk: dict) -> dict:
        if self.on:
            for c in chunk["choices"]:
                c |= self.due.pop(c["index"], None) or {"token_ids": []}
        return chunk


def completion_extras(req, full: dict, choices: list[dict]) -> None:
    """vLLM's per-choice extras of a whole /v1/completions response: prompt_logprobs ({token id: logprob}, the first
    token's null, as on the chat route), and with return_token_ids the prompt's and the choice's token ids."""
    for shaped, c in zip(full["choices"], choices):
        if req.prompt_logprobs is not None:
            shaped["prompt_logprobs"] = c["prompt_logprobs"]
        if req.return_token_ids:
            shaped["prompt_token_ids"], shaped["token_ids"] = c["prompt_token_ids"], c["token_ids"]
