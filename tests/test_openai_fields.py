"""OpenAI's and vLLM's request fields, through the emulator with the real `openai` client on SmolLM2:
history as the SDK hands it back (message.model_dump() of earlier responses), text parts on every role,
and each field of the published request schemas honoured (visibly), accepted and logged as ignored, or refused
naming what cannot be done. tests/test_no_silent_fields.py walks every field in-process; add_special_tokens and
TRUST_REQUEST_CHAT_TEMPLATE are in tests/test_prompt_tokens.py; docs/api.md has the table.

Prompts are observed through vLLM's return_token_ids: the response's prompt_token_ids, decoded here."""

from __future__ import annotations

import copy

import openai
import pytest
from tokenizers import Tokenizer

from bench.procs import Emulator, emulator_env

pytestmark = pytest.mark.slow  # the real SmolLM2 behind the handler

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER = {"type": "function", "function": {"name": "get_weather"}}
# a template that shows the variables a request can set (reasoning_effort, chat_template_kwargs, documents)
VARS = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "effort={{ reasoning_effort | default('unset') }} thinking={{ enable_thinking | default('unset') }} "
    "docs={% for d in documents or [] %}{{ d.title }};{% endfor %}"
)
# a template that loops over content parts (vLLM's "openai" content format): it gets the parts, not a joined string
PARTS = (
    "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %};{% endfor %}"
)


@pytest.fixture(scope="module")
def emu(smollm2_path):
    env = emulator_env(
        MODEL_NAME=str(smollm2_path),
        DTYPE="float32",
        MAX_MODEL_LEN="2048",
        OPENAI_SERVED_MODEL_NAME_OVERRIDE="smol",
        TRUST_REQUEST_CHAT_TEMPLATE="true",  # vLLM's opt-in for a request's own chat_template
    )
    e = Emulator(env)
    yield e
    e.close()


@pytest.fixture(scope="module")
def oai(emu):
    return openai.OpenAI(base_url=f"{emu.base}/openai/v1", api_key="local", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer.from_file(str(smollm2_path / "tokenizer.json"))


def chat(oai, messages, **kw):
    """A greedy chat completion; extra_body merges with return_token_ids (so the prompt can be read back)."""
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    args = {"max_tokens": 4, "temperature": 0, **kw}
    return oai.chat.completions.create(model="smol", messages=messages, extra_body=extra, **args)


def prompt_of(r, tok) -> str:
    return tok.decode(r.prompt_token_ids, skip_special_tokens=False)


def refused(call) -> tuple[str, str]:
    """(param without the job's prefix, message) of the 400 that `call` gets."""
    with pytest.raises(openai.BadRequestError) as e:
        call()
    err = e.value.body
    return (err["param"] or "").removeprefix("openai_input."), err["message"]


def text_parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


def test_history_from_model_dump_of_earlier_responses(oai, tok):
    """An agent loop: each response's message.model_dump() (refusal, audio, function_call, annotations null) goes back
    into the history as it is, with a tool-call turn and its tool message."""
    history = [
        {"role": "system", "content": text_parts("You answer briefly.")},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    first = chat(oai, history, tools=[TOOL], tool_choice=WEATHER, max_tokens=30)
    msg = first.choices[0].message
    assert msg.tool_calls and msg.tool_calls[0].function.name == "get_weather"
    dumped = msg.model_dump()
    assert {"refusal", "audio", "function_call", "annotations"} <= dumped.keys()  # the SDK's nulls, sent back
    assert dumped["refusal"] is None and dumped["audio"] is None and dumped["function_call"] is None
    call_id = msg.tool_calls[0].id
    history += [dumped, {"role": "tool", "tool_call_id": call_id, "content": text_parts("18 C and sunny")}]
    second = chat(oai, history, tools=[TOOL], tool_choice="none", max_tokens=8)
    history += [second.choices[0].message.model_dump(), {"role": "user", "content": text_parts("Thanks. And Rome?")}]
    third = chat(oai, history, tools=[TOOL], tool_choice="none", max_tokens=4)
    prompt = prompt_of(third, tok)
    for piece in (
        "<|im_start|>system\nYou answer briefly.<|im_end|>",
        '"name": "get_weather"',  # the call, as text in the hermes format (SmolLM2's template knows no tool_calls)
        "<|im_start|>tool\n18 C and sunny<|im_end|>",
        f"<|im_start|>assistant\n{second.choices[0].message.content}<|im_end|>",
        "<|im_start|>user\nThanks. And Rome?<|im_end|>",
    ):
        assert piece in prompt, (piece, prompt)


def test_text_parts_on_every_role_and_the_functions_api_history(oai, tok):
    """Text parts on every role, joined with "\\n" for a template that wants a string (vLLM's "string" format);
    developer renders as system; an assistant's refusal part is its text; the deprecated functions API's
    function_call and function message render as a tool call and its result."""
    messages = [
        {"role": "system", "content": text_parts("S1", "S2")},
        {"role": "developer", "content": text_parts("D1", "D2")},
        {"role": "user", "content": text_parts("U1", "U2")},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "A1"}, {"type": "refusal", "refusal": "A2"}],
            "function_call": {"name": "lookup", "arguments": '{"q": 1}'},
        },
        {"role": "function", "name": "lookup", "content": "F1"},
        {"role": "assistant", "content": None, "refusal": "R1"},
        {"role": "tool", "tool_call_id": "c9", "content": text_parts("T1", "T2")},
        {"role": "user", "content": "go"},
    ]
    prompt = prompt_of(chat(oai, messages), tok)
    for role, text in (
        ("system", "S1\nS2"),
        ("system", "D1\nD2"),
        ("user", "U1\nU2"),
        ("assistant", 'A1\nA2<tool_call>\n{"name": "lookup", "arguments": {"q": 1}}\n</tool_call>'),
        ("tool", "F1"),
        ("assistant", "R1"),
        ("tool", "T1\nT2"),
    ):
        assert f"<|im_start|>{role}\n{text}<|im_end|>" in prompt, (role, text, prompt)
    # a template that loops over the parts gets them as parts (strings stay strings, as transformers hands them)
    looped = prompt_of(chat(oai, messages[2:3] + messages[-1:], extra_body={"chat_template": PARTS}), tok)
    assert looped == "user:[U1][U2];user:go;"


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
    ],
)
def test_a_part_we_cannot_serve_is_refused_naming_its_type_and_path(oai, part):
    messages = [{"role": "system", "content": "hi"}, {"role": "user", "content": [*text_parts("look"), part]}]
    param, message = refused(lambda: chat(oai, messages))
    assert param == "messages.1.content.1.type"
    assert f"{part['type']} content parts are not supported" in message and "text only" in message


def test_history_fields_we_cannot_honour_are_refused_naming_them(oai):
    user = {"role": "user", "content": "hi"}
    cases = [
        ({"role": "assistant", "content": None, "audio": {"id": "audio_1"}}, "messages.1.audio", "no audio"),
        ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}, "messages.1.content.0.type", "refusal"),
        ({"role": "user", "content": [{"type": "thinking", "text": "x"}]}, "messages.1.content.0.type", "'thinking'"),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {"name": "x", "input": ""}}]},
            "messages.1.tool_calls.0.type",
            "'custom'",
        ),
    ]
    for message, path, words in cases:
        param, text = refused(lambda m=message: chat(oai, [user, m]))
        assert param == path and words in text, (message, param, text)


def test_template_fields_reach_the_template(oai, tok):
    """reasoning_effort, chat_template_kwargs, documents and a request's own chat_template, as vLLM passes them."""
    user = [{"role": "user", "content": "hi"}]

    def rendered(**kw):
        extra = {"chat_template": VARS, **kw.pop("extra_body", {})}
        return prompt_of(chat(oai, user, extra_body=extra, **kw), tok)

    assert rendered() == "user: hi\neffort=unset thinking=unset docs="
    assert "effort=low " in rendered(reasoning_effort="low")
    assert "thinking=False " in rendered(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # the request's own field over the same name in chat_template_kwargs (vLLM's order)
    both = rendered(reasoning_effort="high", extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}})
    assert "effort=high " in both
    docs = [{"title": "A", "text": "a"}, {"title": "B", "text": "b"}]
    assert "docs=A;B;" in rendered(extra_body={"documents": docs})


def test_continue_final_message_and_echo(oai, tok):
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favorite color is"}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    cont = chat(oai, messages, max_tokens=6, extra_body=body)
    assert prompt_of(cont, tok).endswith("<|im_start|>assistant\nMy favorite color is")  # open, no <|im_end|>
    echoed = chat(oai, messages, max_tokens=6, extra_body={**body, "echo": True})
    assert echoed.choices[0].message.content == "My favorite color is" + cont.choices[0].message.content
    # streamed: the echo goes out first
    stream = chat(oai, messages, max_tokens=6, stream=True, extra_body={**body, "echo": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == echoed.choices[0].message.content
    param, message = refused(lambda: chat(oai, messages, extra_body={"continue_final_message": True}))
    assert param == "continue_final_message" and "add_generation_prompt" in message


def test_token_fields(oai):
    """truncate_prompt_tokens, return_token_ids (whole and streamed), return_tokens_as_token_ids, on both routes."""
    user = [{"role": "user", "content": "Count from one to ten, please, slowly."}]
    whole = chat(oai, user, max_tokens=5, logprobs=True, top_logprobs=2)
    ids = whole.choices[0].token_ids
    assert len(ids) == whole.usage.completion_tokens == 5
    assert [t.token for t in whole.choices[0].logprobs.content] != [f"token_id:{i}" for i in ids]
    named = chat(
        oai, user, max_tokens=5, logprobs=True, top_logprobs=2, extra_body={"return_tokens_as_token_ids": True}
    )
    assert [t.token for t in named.choices[0].logprobs.content] == [f"token_id:{i}" for i in ids]
    assert all(top.token.startswith("token_id:") for t in named.choices[0].logprobs.content for top in t.top_logprobs)
    stream = list(chat(oai, user, max_tokens=5, stream=True))
    assert stream[0].prompt_token_ids == whole.prompt_token_ids
    assert [i for c in stream if c.choices for i in c.choices[0].token_ids] == ids
    short = chat(oai, user, max_tokens=5, extra_body={"truncate_prompt_tokens": 6})
    assert short.prompt_token_ids == whole.prompt_token_ids[-6:] and short.usage.prompt_tokens == 6
    # /v1/completions: per choice, as vLLM's completion choices carry them
    comp = oai.completions.create(
        model="smol",
        prompt="The capital of France is",
        max_tokens=3,
        temperature=0,
        logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1},
    )
    choice = comp.choices[0]
    assert len(choice.token_ids) == 3 and choice.logprobs.tokens == [f"token_id:{i}" for i in choice.token_ids]
    assert len(choice.prompt_logprobs) == len(choice.prompt_token_ids) == comp.usage.prompt_tokens
    assert choice.prompt_logprobs[0] is None and str(choice.prompt_token_ids[1]) in choice.prompt_logprobs[1]
    cut = oai.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=1, extra_body={"truncate_prompt_tokens": 2}
    )
    assert cut.usage.prompt_tokens == 2


def test_n_above_one_with_tools(oai):
    """n > 1 with tools works: each choice is constrained and parsed on its own (nothing to refuse)."""
    r = chat(oai, [{"role": "user", "content": "Weather in Paris?"}], tools=[TOOL], tool_choice=WEATHER, n=2,
             temperature=1.0, seed=3, max_tokens=30)  # fmt: skip
    assert len(r.choices) == 2
    assert all(c.message.tool_calls[0].function.name == "get_weather" for c in r.choices)


def test_no_op_values_are_never_refused(oai):
    """A field of a published schema set to its default (or another value that asks for nothing) is accepted."""
    r = chat(
        oai,
        [{"role": "user", "content": "hi"}],
        modalities=["text"],
        function_call="none",
        audio=None,
        prediction=None,
        extra_body={
            "include_reasoning": True,
            "use_beam_search": False,
            "priority": 0,
            "allowed_token_ids": None,
            "bad_words": [],
            "logits_processors": None,
            "max_repetition_pattern_size": 0,
            "add_special_tokens": False,
            "echo": False,
        },
    )
    assert r.choices[0].message.content


IGNORED = {  # a chat request sending every field this worker accepts and ignores
    "user": "u-1",
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "auto",
    "safety_identifier": "s-1",
    "prompt_cache_key": "k-1",
    "prompt_cache_retention": "24h",
    "verbosity": "low",
}
IGNORED_EXTRA = {
    "prompt_cache_options": {"ttl": "30m"},
    "request_id": "r-1",
    "length_penalty": 0.5,
    "spaces_between_special_tokens": False,
    "mm_processor_kwargs": {"num_crops": 4},
    "guided_decoding_backend": "outlines",
}


def test_ignored_fields_are_accepted_and_logged_once(oai, emu):
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "Hello.",
            "annotations": [
                {
                    "type": "url_citation",
                    "url_citation": {"url": "https://example.com", "title": "t", "start_index": 0, "end_index": 1},
                }
            ],
        },  # fmt: skip
        {"role": "user", "content": "Bye."},
    ]
    plain = chat(oai, messages)
    for _ in range(2):
        r = chat(oai, messages, **IGNORED, extra_body=IGNORED_EXTRA)
        assert r.choices[0].message.content == plain.choices[0].message.content
        assert r.prompt_token_ids == plain.prompt_token_ids
        s = chat(oai, messages, stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
        assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == plain.choices[0].message.content
    for field in [*IGNORED, *IGNORED_EXTRA, "annotations", "include_obfuscation"]:
        lines = [line for line in emu.lines if f".{field} is accepted and ignored" in line]
        assert len(lines) == 1, (field, emu.tail())


REFUSED = [  # (SDK kwargs, the field named, words saying what cannot be done)
    ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio", "text only"),
    ({"modalities": ["text", "audio"]}, "modalities", "audio modality"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "Predicted Outputs"),
    ({"web_search_options": {}}, "web_search_options", "no search tool"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "tools"),
    ({"function_call": {"name": "f"}}, "function_call", "tool_choice"),
    ({"extra_body": {"moderation": {"model": "omni-moderation-latest"}}}, "moderation", "no moderation"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search", "beam search"),
    ({"extra_body": {"allowed_token_ids": [5, 6]}}, "allowed_token_ids", "token list"),
    ({"extra_body": {"bad_words": ["blue"]}}, "bad_words", "word sequences"),
    ({"extra_body": {"priority": 5}}, "priority", "first come, first served"),
    ({"extra_body": {"logits_processors": ["my.Proc"]}}, "logits_processors", "no request code"),
    ({"extra_body": {"include_reasoning": False}}, "include_reasoning", "reasoning parser"),
    ({"extra_body": {"cache_salt": "s3cr3t"}}, "cache_salt", "shared by all requests"),
    ({"extra_body": {"kv_transfer_params": {"do_remote_decode": True}}}, "kv_transfer_params", "KV transfer"),
    ({"extra_body": {"vllm_xargs": {"k": 1}}}, "vllm_xargs", "extensions"),
    ({"extra_body": {"repetition_min_count": 3}}, "repetition_min_count", "repeated token patterns"),
    ({"extra_body": {"structural_tag": "{}"}}, "structural_tag", "structural tags"),
    ({"extra_body": {"guided_whitespace_pattern": " "}}, "guided_whitespace_pattern", "whitespace"),
    ({"extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens", "keeps no token"),
]


@pytest.mark.parametrize("kwargs, field, words", REFUSED, ids=[f for _, f, _ in REFUSED])
def test_refused_fields_say_what_cannot_be_done(oai, kwargs, field, words):
    kwargs = copy.deepcopy(kwargs)
    param, message = refused(lambda: chat(oai, [{"role": "user", "content": "hi"}], **kwargs))
    assert param == field and words in message, (param, message)


def test_a_name_in_no_schema_is_refused_naming_it(oai):
    param, message = refused(lambda: chat(oai, [{"role": "user", "content": "hi"}], extra_body={"temprature": 0.2}))
    assert param == "temprature" and "unknown field" in message
    bad_part = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]
    param, message = refused(lambda: chat(oai, bad_part))
    assert param == "messages.0.content.0.cache_control" and "unknown field" in message
