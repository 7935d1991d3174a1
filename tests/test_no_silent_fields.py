"""No silent no-ops. Every request field (the pydantic models of handler/schemas.py: native jobs and the OpenAI
routes) and every engine SamplingParams field a job reaches changes behaviour, is refused with an error naming it,
or is listed in handler.schemas.IGNORED_FIELDS (then it must change nothing and be logged). Settings have their own
walk in tests/test_no_silent_settings.py.

The walks iterate the models' own field lists: a field added without a case here fails. Request fields run through
the real handler on a tiny engine (LoRA on, a chat template that renders every message field); the observation is
what the engine receives (prompt, SamplingParams, adapter) and what the job returns."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import json
import logging
import shutil

import pytest
from pydantic import BaseModel
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, processors

from engine import LLM, AsyncEngine, EngineConfig, PoolingParams, SamplingParams, StructuredOutputsParams
from handler import schemas
from handler.settings import load_settings
from handler.worker import Worker
from tests.lora_fixtures import make_peft_adapter

# renders every message field, tools, documents and template variables, so each one shows in the prompt the
# engine gets
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}"
    "{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}>{{ m.reasoning_content or '' }}{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }}]{% endfor %}{% endfor %}"
    "{% if tools %}T{{ tools | length }}{% endif %}{% if greeting is defined %}{{ greeting }}{% endif %}"
    "{% if reasoning_effort is defined %}E{{ reasoning_effort }}{% endif %}"
    "{% for d in documents or [] %}D{{ d.title }}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CALL = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
USER = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
NATIVE = {"prompt": "The quick brown", "sampling_params": GREEDY}
CHAT = {"openai_route": "/v1/chat/completions", "openai_input": {"messages": USER, **GREEDY}}
COMPLETIONS = {"openai_route": "/v1/completions", "openai_input": {"prompt": "The quick brown", **GREEDY}}

# Per field: (value, patch, expected). The patch is merged into the job (base and case) first; expected is "engine"
# (what the engine gets differs: prompt, SamplingParams or adapter; test_the_engine_honours_every_sampling_field
# shows the engine acts on each SamplingParams field), "output" (what the job returns differs) or "refused" (an
# error naming the field).
SAMPLING = {  # vLLM's sampling names: native sampling_params and the OpenAI bodies alike
    "n": (2, {}, "output"),
    "temperature": (0.5, {}, "engine"),
    "top_p": (0.5, {}, "engine"),
    "top_k": (5, {}, "engine"),
    "min_p": (0.1, {}, "engine"),
    "presence_penalty": (1.0, {}, "engine"),
    "frequency_penalty": (1.0, {}, "engine"),
    "repetition_penalty": (1.5, {}, "engine"),
    "seed": (3, {}, "engine"),
    "stop": (["x"], {}, "engine"),
    "stop_token_ids": ([5], {}, "engine"),
    "ignore_eos": (False, {}, "engine"),
    "max_tokens": (2, {}, "output"),
    "min_tokens": (2, {}, "engine"),
    "skip_special_tokens": (False, {}, "engine"),
    "include_stop_str_in_output": (True, {}, "engine"),
    "response_format": ({"type": "json_object"}, {}, "engine"),
    "structured_outputs": ({"regex": "[ab]+"}, {}, "engine"),
    "guided_json": ({"type": "object"}, {}, "engine"),
    "guided_regex": ("[ab]+", {}, "engine"),
    "guided_choice": (["a", "b"], {}, "engine"),
    "guided_grammar": ('root ::= "a"', {}, "engine"),
    "logit_bias": ({"5": 100.0}, {}, "engine"),
}
OPENAI = {  # _OpenAIBase: both routes
    **SAMPLING,
    "model": ("a", {}, "engine"),  # a LoRA adapter's name
    "stream": (True, {}, "output"),
    "stream_options": ({"include_usage": True}, {"stream": True}, "output"),
    # vLLM's extra parameters (handler/openai_extras.py; unservable.py for the refused)
    "truncate_prompt_tokens": (2, {}, "engine"),
    "return_token_ids": (True, {}, "output"),
    "cache_salt": ("s", {}, "refused"),  # the walker's prefix cache is on: shared, no per-salt keys
    "use_beam_search": (True, {}, "refused"),
    "allowed_token_ids": ([5], {}, "refused"),
    "priority": (1, {}, "refused"),
    "logits_processors": (["m.P"], {}, "refused"),
    "kv_transfer_params": ({"do_remote_prefill": True}, {}, "refused"),
    "vllm_xargs": ({"k": 1}, {}, "refused"),
    "max_repetition_pattern_size": (4, {}, "refused"),
    "min_repetition_pattern_size": (2, {}, "refused"),
    "repetition_min_count": (3, {}, "refused"),
    "guided_whitespace_pattern": (" ", {}, "refused"),
    "structural_tag": ("{}", {}, "refused"),
}
CASES = {
    "NativeJob": {
        "prompt": ("Other words", {}, "engine"),
        "messages": (USER, {}, "engine"),
        "apply_chat_template": (True, {}, "engine"),
        "sampling_params": ({"max_tokens": 2}, {}, "output"),
        "stream": (True, {}, "output"),
        "max_batch_size": (2, {"stream": True}, "output"),
        "min_batch_size": (2, {"stream": True}, "output"),
        "batch_size_growth_factor": (2.0, {"stream": True}, "output"),
        "use_openai_format": (True, {"messages": USER}, "output"),
        "lora": ("a", {}, "engine"),
    },
    "NativeSamplingParams": {**SAMPLING, "logprobs": (1, {}, "output"), "prompt_logprobs": (1, {}, "output")},
    "LoRASpec": {
        "name": ("a", {}, "engine"),
        "s3_uri": ("s3://elsewhere/a/", {}, "refused"),  # no LORA_ALLOWED_BUCKETS here; tests/test_lora_serving.py
    },
    "Message": {  # set on the last message of a chat job
        "role": ("system", {}, "engine"),
        "content": ("bye", {}, "engine"),
        "name": ("ann", {}, "engine"),
        "tool_calls": (CALL, {"messages": USER + [{"role": "assistant", "content": "ok"}]}, "engine"),
        "tool_call_id": ("c1", {"messages": USER + [{"role": "tool", "content": "3"}]}, "engine"),
        "refusal": ("no", {"messages": USER + [{"role": "assistant", "content": "ok"}]}, "engine"),
        "function_call": ({"name": "f", "arguments": "{}"}, {"messages": USER + [{"role": "assistant"}]}, "engine"),
        "audio": ({"id": "audio_1"}, {"messages": USER + [{"role": "assistant", "content": "ok"}]}, "refused"),
        "reasoning_content": ("hm", {"messages": USER + [{"role": "assistant", "content": "ok"}]}, "engine"),
        "reasoning": ("hm", {"messages": USER + [{"role": "assistant", "content": "ok"}]}, "engine"),
    },
    "ChatCompletionRequest": {
        **OPENAI,
        "messages": ([{"role": "user", "content": "bye"}], {}, "engine"),
        "max_completion_tokens": (2, {}, "output"),
        "logprobs": (True, {}, "output"),
        "top_logprobs": (2, {"logprobs": True}, "output"),
        "add_generation_prompt": (False, {}, "engine"),
        "chat_template_kwargs": ({"greeting": "yo"}, {}, "engine"),
        "tools": ([TOOL], {}, "engine"),
        "tool_choice": ("required", {"tools": [TOOL]}, "engine"),
        "parallel_tool_calls": (False, {"tools": [TOOL], "tool_choice": "required"}, "engine"),
        "prompt_logprobs": (1, {}, "output"),
        "return_tokens_as_token_ids": (True, {"logprobs": True}, "output"),
        "reasoning_effort": ("low", {}, "engine"),
        "echo": (True, {"add_generation_prompt": False}, "output"),  # the reply starts with the user's "hi"
        "continue_final_message": (
            True,
            {"add_generation_prompt": False, "chat_template_kwargs": {"greeting": "yo"}},
            "engine",
        ),  # the trailing greeting is cut
        "add_special_tokens": (True, {}, "engine"),  # the walker's tokenizer adds a BOS
        "documents": ([{"title": "t", "text": "x"}], {}, "engine"),
        "chat_template": ("{% for m in messages %}{{ m.content }}{% endfor %}", {}, "engine"),
        "audio": ({"voice": "alloy", "format": "wav"}, {}, "refused"),
        "modalities": (["text", "audio"], {}, "refused"),
        "functions": ([{"name": "f"}], {}, "refused"),
        "function_call": ({"name": "f"}, {}, "refused"),
        "moderation": ({"model": "omni-moderation-latest"}, {}, "refused"),
        "prediction": ({"type": "content", "content": "x"}, {}, "refused"),
        "web_search_options": ({}, {}, "refused"),
        "include_reasoning": (False, {}, "refused"),
        "bad_words": (["x"], {}, "refused"),
    },
    "CompletionRequest": {
        **OPENAI,
        "prompt": (["Other words", "More"], {}, "engine"),  # a batch: one engine request per prompt
        "max_tokens": (0, {"echo": True}, "output"),  # scoring: the prompt echoed, nothing generated
        "logprobs": (1, {}, "output"),
        "echo": (True, {}, "output"),
        "suffix": ("x", {}, "refused"),
        "best_of": (2, {}, "refused"),
        "return_tokens_as_token_ids": (True, {"logprobs": 1}, "output"),
        "add_special_tokens": (False, {}, "engine"),  # the walker's tokenizer adds a BOS: not now
        "prompt_logprobs": (1, {}, "output"),
        "prompt_embeds": ("AAAA", {}, "refused"),
    },
    "StreamOptions": {
        "include_usage": (True, {}, "output"),
        "continuous_usage_stats": (True, {}, "output"),
    },
}
IGNORED_VALUES = {
    "user": "u1",
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "auto",
    "request_id": "r1",
    "safety_identifier": "s1",
    "prompt_cache_key": "k1",
    "prompt_cache_options": {"ttl": "30m"},
    "prompt_cache_retention": "24h",
    "verbosity": "low",
    "length_penalty": 2.0,
    "spaces_between_special_tokens": False,
    "mm_processor_kwargs": {"k": 1},
    "guided_decoding_backend": "outlines",
    "include_obfuscation": False,
    "annotations": [
        {"type": "url_citation", "url_citation": {"url": "u", "title": "t", "start_index": 0, "end_index": 1}}
    ],
}


def _request_models() -> dict[str, type[BaseModel]]:
    """The request models of handler/schemas.py (the bases named with a leading underscore only share fields)."""
    return {
        n: m
        for n, m in inspect.getmembers(schemas, inspect.isclass)
        if issubclass(m, BaseModel) and m.__module__ == schemas.__name__ and not n.startswith("_")
    }


def _job(model: str, field: str, value, patch: dict) -> tuple[dict, dict]:
    """(base job, job with the field set) for a field of `model`."""

    def where(job):  # the dict the model's fields live in
        if model in ("NativeJob", "LoRASpec"):
            return job
        if model == "NativeSamplingParams":
            return job["sampling_params"]
        return job["openai_input"]

    base = copy.deepcopy(
        {"ChatCompletionRequest": CHAT, "CompletionRequest": COMPLETIONS, "Message": CHAT, "StreamOptions": CHAT}.get(
            model, NATIVE
        )
    )
    if model == "StreamOptions":
        patch = {"stream": True, "stream_options": {}}
    where(base).update(copy.deepcopy(patch))
    job = copy.deepcopy(base)
    if model == "Message":
        job["openai_input"]["messages"][-1][field] = value
    elif model == "LoRASpec":
        job["lora"] = {"name": "a"} | {field: value}
    elif model == "StreamOptions":
        job["openai_input"]["stream_options"][field] = value
    else:
        where(job)[field] = value
    return base, job


class Spy(AsyncEngine):
    """The real engine; it records what each job hands it: the validated request (prompt token ids, SamplingParams,
    adapter)."""

    seen: list

    def generate(self, prompt, params=None, request_id=None, lora=None):
        self.seen.append(copy.deepcopy(prompt))  # the handler hands it a ValidRequest
        return super().generate(prompt, params, request_id, lora)


def _strip(x):
    """Drop what differs between two runs of the same job (ids, clocks, prefix-cache hits)."""
    if isinstance(x, dict):
        drop = {"id", "created", "metrics", "cached_input", "prompt_tokens_details"}
        return {k: _strip(v) for k, v in x.items() if k not in drop}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    if isinstance(x, str) and x.startswith("data: "):  # an SSE yield: its events
        return [e[6:] if e == "data: [DONE]" else _strip(json.loads(e[6:])) for e in x.split("\n\n") if e]
    return x


def observe(w: Worker, inp: dict) -> dict:
    async def go():
        return [c async for c in w.handle({"id": "walk", "input": inp})]

    w.engine.seen = []
    chunks = asyncio.run(go())
    if len(chunks) == 1 and isinstance(chunks[0], dict) and "error" in chunks[0]:
        return {"error": json.loads(chunks[0]["error"])}
    return {"engine": w.engine.seen, "output": _strip(chunks)}


@pytest.fixture(scope="module")
def walker(tiny_llama, tmp_path_factory):
    adapter, _ = make_peft_adapter(tiny_llama, tmp_path_factory.mktemp("walk") / "a")
    model = tmp_path_factory.mktemp("walk") / "m"  # the tiny llama, its tokenizer adding a BOS (add_special_tokens)
    shutil.copytree(tiny_llama, model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(model / "tokenizer.json"))
    cfg = EngineConfig(
        model=str(model),
        dtype="float32",
        num_kv_blocks=128,
        max_model_len=256,
        log_stats_interval=0,
        enable_lora=True,
        lora_modules=(("a", str(adapter)),),
    )
    eng = Spy(cfg)
    env = {
        "CUSTOM_CHAT_TEMPLATE": TEMPLATE,
        "STREAM_FLUSH_MS": "3600000",  # yields by count alone: the same job streams the same chunks
        "ENABLE_LORA": "true",
        "ENABLE_AUTO_TOOL_CHOICE": "true",
        "TOOL_CALL_PARSER": "hermes",
        "TRUST_REQUEST_CHAT_TEMPLATE": "true",  # the chat_template field renders (without it: refused)
    }
    yield Worker(load_settings(env), eng)
    eng.shutdown()


def test_every_request_field_is_honoured_refused_or_listed_ignored(walker, monkeypatch, caplog):
    models = _request_models()
    assert set(models) == set(CASES), "a request model without a case table here (or a stale table)"
    monkeypatch.setattr(schemas, "_warned", set())
    assert walker.fault is None
    bases: dict[str, dict] = {}
    for name, model in models.items():
        missing = set(model.model_fields) - set(CASES[name]) - set(schemas.IGNORED_FIELDS)
        assert not missing, f"{name}: fields with no case (honoured, refused or IGNORED_FIELDS): {sorted(missing)}"
        for field in model.model_fields:
            if field in schemas.IGNORED_FIELDS:
                value, patch, expected = IGNORED_VALUES[field], {}, "ignored"
            else:
                value, patch, expected = CASES[name][field]
            base, job = _job(name, field, value, patch)
            key = json.dumps(base, sort_keys=True)
            if key not in bases:
                bases[key] = observe(walker, base)
                assert "error" not in bases[key], (name, field, bases[key])
            caplog.clear()
            schemas._warned.clear()  # warned once per process: here once per case
            with caplog.at_level(logging.WARNING, logger="handler"):
                got = observe(walker, job)
            what = f"{name}.{field}={value!r}"
            if expected == "refused":
                err = got.get("error")
                assert err, f"{what} was accepted"
                assert field in (err["param"] or "") or field in err["message"], (what, err)
            elif expected == "ignored":
                assert got == bases[key], f"{what} is listed as ignored but changed the job"
                assert f".{field} is accepted and ignored" in caplog.text, what
            else:
                assert "error" not in got, (what, got)
                assert got[expected] != bases[key][expected], f"{what} did not change the job's {expected}"


def test_ignored_request_fields_warn_once(walker, monkeypatch, caplog):
    monkeypatch.setattr(schemas, "_warned", set())
    job = copy.deepcopy(CHAT)
    job["openai_input"]["user"] = "u1"
    with caplog.at_level(logging.WARNING, logger="handler"):
        observe(walker, job)
        observe(walker, job)
    assert caplog.text.count("openai_input.user is accepted and ignored") == 1


def test_parallel_tool_calls_false_keeps_one_auto_call(walker):
    """tool_choice "auto" with an output that makes two calls (forced by a one-choice grammar): parallel_tool_calls
    false returns the first only, whole and streamed."""
    two = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>'
    body = {"messages": USER, "tools": [TOOL], "guided_choice": [two], "max_tokens": 120, "temperature": 0}
    for parallel, calls in ((None, 2), (False, 1)):
        for stream in (False, True):
            inp = {"openai_route": "/v1/chat/completions", "openai_input": {**body, "stream": stream}}
            if parallel is not None:
                inp["openai_input"]["parallel_tool_calls"] = parallel
            out = observe(walker, inp)["output"]
            if stream:
                deltas = [
                    d
                    for y in out
                    for e in y
                    if isinstance(e, dict)
                    for d in e["choices"][0]["delta"].get("tool_calls", [])
                ]
                got = sum("type" in d for d in deltas)
            else:
                got = len(out[0]["choices"][0]["message"]["tool_calls"])
            assert got == calls, (parallel, stream, out)


# ---- the engine honours every SamplingParams field (the walk above shows each reaches it) ------------------------


@pytest.fixture(scope="module")
def eos_model(tiny_llama, tmp_path_factory):
    """The tiny llama, except that its head row for EOS is 1.01 x the row of the token greedy decoding picks third
    for PROMPT: so the output ends with EOS at the third token (the EOS-driven fields need an EOS to act on)."""
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    third = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=3))[0]
    llm.engine.shutdown()
    out = tmp_path_factory.mktemp("eos") / "m"
    shutil.copytree(tiny_llama, out)
    (w,) = out.glob("*.safetensors")
    tensors = load_file(str(w))
    head = tensors["lm_head.weight"]
    head[2] = head[third.outputs[0].token_ids[2]] * 1.01
    save_file(tensors, str(w), metadata={"format": "pt"})
    llm = LLM(str(out), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    yield llm
    llm.engine.shutdown()


PROMPT = [5, 40, 77, 120, 33, 9]
SAMPLED = {"temperature": 1.5, "seed": 0, "max_tokens": 12}
LOOP = {"temperature": 0, "max_tokens": 32, "ignore_eos": True}  # past the EOS, and long enough to repeat tokens
PLAIN = {"temperature": 0, "max_tokens": 12}  # ends with EOS at the third token
ENGINE_CASES = {  # field: (base, change)
    "n": (SAMPLED, {"n": 2}),
    "temperature": (SAMPLED, {"temperature": 0}),
    "top_p": (SAMPLED, {"top_p": 0.2}),
    "top_k": (SAMPLED, {"top_k": 2}),
    "min_p": (SAMPLED, {"min_p": 0.5}),
    "presence_penalty": (LOOP, {"presence_penalty": 2.0}),
    "frequency_penalty": (LOOP, {"frequency_penalty": 2.0}),
    "repetition_penalty": (LOOP, {"repetition_penalty": 2.0}),
    "seed": (SAMPLED, {"seed": 1}),
    "stop": (LOOP, None),  # these three from the loop's own output, below
    "stop_token_ids": (LOOP, None),
    "ignore_eos": (PLAIN, {"ignore_eos": True}),
    "max_tokens": (LOOP, {"max_tokens": 3}),
    "min_tokens": (PLAIN, {"min_tokens": 6}),
    "logprobs": (PLAIN, {"logprobs": 2}),
    "skip_special_tokens": (LOOP, {"skip_special_tokens": False}),  # the EOS shows as text
    "include_stop_str_in_output": (LOOP, None),
    "structured_outputs": (PLAIN, {"structured_outputs": StructuredOutputsParams(choice=["ab", "cd"])}),
    "prompt_logprobs": (PLAIN, {"prompt_logprobs": 1}),
    "logit_bias": (PLAIN, {"logit_bias": {5: 100.0}}),
    "pooling": (PLAIN, {"pooling": PoolingParams()}),  # an embedding: nothing generated, a vector
}


def _seen(out) -> tuple:
    return out.prompt_logprobs, out.embedding, [(c.text, c.token_ids, c.finish_reason, c.logprobs) for c in out.outputs]


def test_the_engine_honours_every_sampling_field(eos_model):
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields == set(ENGINE_CASES), "a SamplingParams field without an engine case (or a stale one)"
    plain, loop = eos_model.generate(
        [{"prompt_token_ids": PROMPT}] * 2, [SamplingParams(**PLAIN), SamplingParams(**LOOP)]
    )
    assert plain.outputs[0].finish_reason == "stop" and len(plain.outputs[0].token_ids) < 12  # ended by EOS
    text, ids = loop.outputs[0].text, loop.outputs[0].token_ids
    assert len(set(ids)) < len(ids)  # a repeated token: what presence and frequency penalties act on
    stop = {"stop": [text[len(text) // 2 :][:2]]}  # a string from the middle of the loop's text
    cases = dict(
        ENGINE_CASES,
        stop=(LOOP, stop),
        stop_token_ids=(LOOP, {"stop_token_ids": [ids[5]]}),
        include_stop_str_in_output=({**LOOP, **stop}, {"include_stop_str_in_output": True}),
    )
    params = [SamplingParams(**b) for b, _ in cases.values()] + [
        SamplingParams(**{**b, **c}) for b, c in cases.values()
    ]
    outs = eos_model.generate([{"prompt_token_ids": PROMPT}] * len(params), params)
    for i, field in enumerate(cases):
        assert _seen(outs[i]) != _seen(outs[len(cases) + i]), f"SamplingParams.{field} changed nothing"


def test_enforce_eager_false_where_graphs_cannot_run_logs_why_once(tiny_llama, caplog):
    """ENFORCE_EAGER=false on CPU: the engine starts eager and says why, once, at WARNING."""
    with caplog.at_level(logging.WARNING, logger="engine"):
        llm = LLM(str(tiny_llama), enforce_eager=False, num_kv_blocks=16, log_stats_interval=0)
        llm.generate("The quick", SamplingParams(max_tokens=2))
        llm.engine.shutdown()
        eager = LLM(str(tiny_llama), num_kv_blocks=16, log_stats_interval=0)  # the default: nothing to say
        eager.engine.shutdown()
    lines = [r for r in caplog.records if "ENFORCE_EAGER=false is ignored" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and "CUDA" in lines[0].getMessage()
    assert not llm.engine.graphs_enabled and llm.engine.device.type == "cpu"
