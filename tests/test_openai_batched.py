"""/v1/completions as OpenAI clients send it, through the emulator with the official `openai` client on SmolLM2:
batched prompts (strings and token ids) with n, echo, logprobs and streaming; max_tokens=0 with echo (scoring);
system_fingerprint; "usage": null on the chunks before the usage chunk. fp32 and greedy, so a prompt's text in a
batch is the text it gets alone."""

from __future__ import annotations

import json
import re

import openai
import pytest
import requests
from tokenizers import Tokenizer

from bench.procs import Emulator, emulator_env
from handler import openai_compat as oa
from handler.settings import load_settings

pytestmark = pytest.mark.slow  # the real SmolLM2 behind the handler

PROMPTS = ["The capital of France is", "One, two, three,", "My favourite colour is"]
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def emu(smollm2_path):
    env = emulator_env(
        MODEL_NAME=str(smollm2_path),
        DTYPE="float32",  # greedy text must not depend on the batch's neighbours (bf16 GEMMs round by M)
        MAX_NUM_SEQS="4",  # below a batch's 3 prompts x n=2: the prompts queue, as concurrent jobs do
        MAX_MODEL_LEN="1024",
        OPENAI_SERVED_MODEL_NAME_OVERRIDE="smol",
    )
    e = Emulator(env)
    yield e
    e.close()


@pytest.fixture(scope="module")
def oai(emu):
    return openai.OpenAI(base_url=emu.base_url, api_key="local", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer.from_file(str(smollm2_path / "tokenizer.json"))


def _param(err: openai.BadRequestError) -> str:
    return (err.body or {}).get("param", "").removeprefix("openai_input.")


def _lp(c) -> tuple:
    return (c.logprobs.tokens, c.logprobs.text_offset) if c.logprobs else None


def _close(a: list, b: list, tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or abs(x - y) <= tol for x, y in zip(a, b))


def test_batched_prompts_match_each_prompt_alone(oai, tok):
    """3 prompts x n=2 (6 sequences, MAX_NUM_SEQS=4), echo and logprobs: choice p * n + i is prompt p's choice i,
    the same text, tokens and logprobs as the prompt sent alone; usage sums over the batch."""
    kw = {"model": "smol", "n": 2, "echo": True, "logprobs": 1, **GREEDY}
    batch = oai.completions.create(prompt=PROMPTS, **kw)
    solo = [oai.completions.create(prompt=p, **kw) for p in PROMPTS]
    assert [c.index for c in batch.choices] == list(range(6))
    for p, alone in enumerate(solo):
        for i in range(2):
            got, want = batch.choices[p * 2 + i], alone.choices[i]
            assert got.text == want.text and got.text.startswith(PROMPTS[p]), (p, i)
            assert got.finish_reason == want.finish_reason == "length"
            assert _lp(got) == _lp(want) and _close(got.logprobs.token_logprobs, want.logprobs.token_logprobs)
    for f in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(batch.usage, f) == sum(getattr(s.usage, f) for s in solo), f
    assert batch.usage.completion_tokens == 3 * 2 * 8
    # the same batch as token-id lists (what lm-eval-harness sends): the same choices; prompt as one token list
    ids = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    by_ids = oai.completions.create(prompt=ids, **kw)
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]
    one = oai.completions.create(prompt=ids[1], **kw)
    assert [c.text for c in one.choices] == [c.text for c in solo[1].choices]


def test_batched_stream(oai, emu):
    """Streamed, the same batch: each chunk names its choice, the prompts run together (the last prompt's first
    chunk comes before the first prompt's end), each choice's text (echo and logprobs included) is the whole
    response's, "usage": null on every chunk until the one usage chunk, and the stream ends once."""
    kw = {"model": "smol", "prompt": PROMPTS[:2], "n": 2, "echo": True, "logprobs": 1, **GREEDY}
    whole = oai.completions.create(**kw)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    *body, last = chunks
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    assert all("usage" in c.model_fields_set and c.usage is None for c in body)
    fps = {c.system_fingerprint for c in chunks}
    assert fps == {whole.system_fingerprint} and whole.system_fingerprint.startswith("fp_")
    order = [(c.choices[0].index, c.choices[0].finish_reason) for c in body]
    assert {i for i, _ in order} == {0, 1, 2, 3}
    first_of_last = next(k for k, (i, _) in enumerate(order) if i >= 2)
    end_of_first = next(k for k, (i, f) in enumerate(order) if i == 0 and f)
    assert first_of_last < end_of_first, order  # running together, not one prompt after another
    for c in whole.choices:
        mine = [ch.choices[0] for ch in body if ch.choices[0].index == c.index]
        assert "".join(m.text for m in mine) == c.text
        tokens = [t for m in mine if m.logprobs for t in m.logprobs.tokens]
        offsets = [o for m in mine if m.logprobs for o in m.logprobs.text_offset]
        lps = [x for m in mine if m.logprobs for x in m.logprobs.token_logprobs]
        assert (tokens, offsets) == _lp(c) and _close(lps, c.logprobs.token_logprobs)
        assert [m.finish_reason for m in mine if m.finish_reason] == [c.finish_reason]
    body = {"model": "smol", "prompt": PROMPTS[:2], "n": 2, "max_tokens": 8, "temperature": 0, "stream": True}
    raw = requests.post(f"{emu.base_url}/completions", json=body, timeout=120)
    events = [e for e in raw.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and raw.text.count("[DONE]") == 1
    # without include_usage no chunk names usage (OpenAI's schema: the field only when asked for)
    assert all("usage" not in json.loads(e[6:]) for e in events[:-1])


def test_max_tokens_zero_with_echo_scores_the_prompt(oai):
    """The prompt's tokens and logprobs, nothing generated: the prompt part of an echo with max_tokens=1 (whose
    last token lm-eval-harness drops), in a whole response, a stream and a batch."""
    kw = {"model": "smol", "echo": True, "logprobs": 2, "temperature": 0}
    score = oai.completions.create(prompt=PROMPTS[0], max_tokens=0, **kw)
    one = oai.completions.create(prompt=PROMPTS[0], max_tokens=1, **kw)
    c, ref = score.choices[0], one.choices[0]
    n = len(c.logprobs.tokens)
    assert c.text == PROMPTS[0] and "".join(c.logprobs.tokens) == PROMPTS[0] and n == score.usage.prompt_tokens
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert c.logprobs.tokens == ref.logprobs.tokens[:n] and len(ref.logprobs.tokens) == n + 1
    assert _close(c.logprobs.token_logprobs, ref.logprobs.token_logprobs[:n])
    assert c.finish_reason == "length" and score.usage.completion_tokens == 0
    streamed = [ch.choices[0] for ch in oai.completions.create(prompt=PROMPTS[0], max_tokens=0, stream=True, **kw)]
    assert "".join(s.text for s in streamed) == c.text and [s.finish_reason for s in streamed][-1] == "length"
    assert [t for s in streamed if s.logprobs for t in s.logprobs.tokens] == c.logprobs.tokens
    batch = oai.completions.create(prompt=PROMPTS, max_tokens=0, **kw)
    assert [x.text for x in batch.choices] == PROMPTS and batch.usage.completion_tokens == 0
    plain = oai.completions.create(prompt=PROMPTS[1], max_tokens=0, model="smol", echo=True)
    assert plain.choices[0].text == PROMPTS[1] and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(prompt=PROMPTS[0], max_tokens=0, model="smol")
    assert _param(e.value) == "max_tokens" and "echo" in str(e.value)


@pytest.mark.parametrize(
    "prompt, says",
    [([], "empty list"), ("", "prompt is empty"), (["a", ""], "prompt[1] is empty"), ([[1, 2], []], "prompt[1]")],
)
def test_empty_prompts_are_refused_naming_prompt(oai, prompt, says):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="smol", prompt=prompt, max_tokens=2)
    assert _param(e.value) == "prompt" and says in str(e.value)


def test_a_batched_prompt_that_does_not_fit_is_named(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="smol", prompt=["hi", "hello " * 200], max_tokens=900)
    assert _param(e.value) == "max_tokens" and "prompt 1" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="smol", prompt=[[1, 2], [3, 10**7]], max_tokens=2)
    assert _param(e.value) == "prompt.1"


def test_system_fingerprint_is_stable_on_both_routes(oai, smollm2_path):
    """One value for this deployment, on every response and chunk of both routes: a hash of its configuration
    (the same configuration gives it again, in any process)."""
    chat = [{"role": "user", "content": "Hi"}]
    s = load_settings({"MODEL_NAME": str(smollm2_path), "DTYPE": "float32"})
    fp = oa.system_fingerprint(s.MODEL_NAME, s.MODEL_REVISION, s.DTYPE, s.QUANTIZATION)
    assert re.fullmatch(r"fp_[0-9a-f]{10}", fp)
    full = oai.chat.completions.create(model="smol", messages=chat, max_tokens=2)
    stream = list(
        oai.chat.completions.create(
            model="smol", messages=chat, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    comps = [oai.completions.create(model="smol", prompt="Hi", max_tokens=2) for _ in range(2)]
    assert {full.system_fingerprint} | {c.system_fingerprint for c in stream + comps} == {fp}
    *body, last = stream
    assert last.usage is not None and last.choices == []
    assert body and all("usage" in c.model_fields_set and c.usage is None for c in body)


def test_cancel_aborts_every_prompt_of_a_batch(emu):
    """A streamed batch job cancelled mid-way: every prompt's request is aborted and its KV blocks freed."""
    body = {"prompt": PROMPTS, "max_tokens": 900, "ignore_eos": True, "stream": True}
    r = requests.post(
        f"{emu.base}/run", json={"input": {"openai_route": "/v1/completions", "openai_input": body}}
    ).json()
    while not requests.get(f"{emu.base}/stream/{r['id']}", timeout=60).json().get("stream"):
        pass
    assert requests.post(f"{emu.base}/cancel/{r['id']}").json()["status"] == "CANCELLED"
    m = emu.wait_for(rf"job {r['id']} cancelled .*KV blocks free (\d+)/(\d+), running (\d+), waiting (\d+)", 30)
    assert m.group(1) == m.group(2) and m.group(3) == m.group(4) == "0", m.group(0)
