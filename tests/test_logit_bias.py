"""logit_bias (token id -> bias added to the logits before sampling), vLLM's semantics end to end: SamplingParams
parses JSON's string keys and clamps to [-100, 100] (vllm/sampling_params.py, from_optional); an id past the
vocabulary is refused (vLLM's input processor); the sampler adds the bias after the min_tokens mask and before the
penalties (vllm/v1/sample/sampler.py), and logprobs stay raw. It acts under n-gram verification, under a grammar's
mask (which it cannot lift), on the OpenAI routes, in native jobs and through the emulator with the openai client."""

from __future__ import annotations

import asyncio
import collections
import json
import re

import pytest
import torch

from engine import LLM, AsyncEngine, EngineConfig, InvalidRequestError, SamplingParams, StructuredOutputsParams
from engine.sampler import Sampler
from engine.spec_decode.rejection import verify
from engine.types import MAX_LOGIT_BIAS_TOKENS, Request
from handler.settings import load_settings
from handler.worker import Worker

pytestmark = pytest.mark.slow  # the real SmolLM2

PROMPT = [{"prompt_token_ids": [5, 40, 77, 120, 33, 9]}]
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def ids(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


# ---- SamplingParams ------------------------------------------------------------------------------------------
def test_params_parse_keys_clamp_values_and_name_a_bad_key():
    assert SamplingParams(logit_bias={"7": 1.5, 9: -3, " 11 ": 2}).logit_bias == {7: 1.5, 9: -3.0, 11: 2.0}
    # vLLM clamps (min(100, max(-100, bias))) rather than refusing; a huge int must not overflow float()
    assert SamplingParams(logit_bias={1: 250, 2: -1e9, 3: 10**400}).logit_bias == {1: 100.0, 2: -100.0, 3: 100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None  # nothing to bias: the greedy fast path stays open
    bad = {
        "abc": {"abc": 1.0},
        "-3": {"-3": 1.0},  # never a token id
        "1.5": {"1.5": 1.0},
        "4": {"4": "high"},
        "5": {5: float("nan")},
    }
    for key, lb in bad.items():
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(logit_bias=lb)
        assert e.value.field == f"logit_bias.{key}", (lb, e.value.field)
    for lb in ([1, 2], {i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(logit_bias=lb)
        assert e.value.field == "logit_bias"


# ---- the sampler: one scatter-add for the biased rows -----------------------------------------------------------
def test_sampler_biases_only_the_rows_that_have_one():
    torch.manual_seed(0)
    logits = torch.randn(3, 8)
    params = [
        SamplingParams(temperature=0, logit_bias={1: 5.0, 3: -2.0}, logprobs=1),
        SamplingParams(temperature=0, logprobs=1),
        SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=1),
    ]
    reqs = [Request(f"r{i}", [1], p) for i, p in enumerate(params)]
    s = Sampler(8, torch.device("cpu"))
    got = logits.clone()
    s._apply_logit_bias(got, reqs)
    want = logits.clone()
    want[0, 1] += 5.0
    want[0, 3] -= 2.0
    want[2, 7] += 100.0
    assert torch.equal(got, want)  # row 1, and every other entry, untouched
    tokens, lps = s(logits, reqs)
    assert tokens == want.argmax(-1).tolist() and tokens[2] == 7
    raw = logits.log_softmax(-1)
    for i, (t, lp) in enumerate(zip(tokens, lps)):  # vLLM's raw_logprobs: the bias is not in them
        assert lp[t] == pytest.approx(raw[i, t].item()) and max(lp.values()) <= 0


# ---- the engine on the tiny llama ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    yield llm
    llm.engine.shutdown()


def test_force_and_ban_change_greedy_output_and_logprobs_stay_raw(tiny):
    base = tiny.generate(PROMPT, SamplingParams(**GREEDY, logprobs=1))[0].outputs[0]
    force = next(t for t in range(10, 400) if t not in base.token_ids)
    forced = tiny.generate(PROMPT, SamplingParams(**GREEDY, logprobs=1, logit_bias={str(force): 100}))[0]
    assert forced.outputs[0].token_ids == [force] * 12
    # the first position's logprobs are the raw ones: the unbiased greedy token is still the top one, with its
    # logprob unchanged, and the forced token has its own (low) logprob, not ~0
    first, raw_top = forced.outputs[0].logprobs[0], base.token_ids[0]
    assert max(first, key=first.get) == raw_top and first[raw_top] == pytest.approx(base.logprobs[0][raw_top])
    assert first[force] < first[raw_top]
    ban = base.token_ids[0]
    banned = tiny.generate(PROMPT, SamplingParams(**GREEDY, logit_bias={ban: -100}))[0].outputs[0].token_ids
    assert banned != base.token_ids and ban not in banned


def test_seeded_sampling_never_emits_a_banned_token(tiny):
    sp = {"temperature": 1.0, "seed": 0, "n": 4, "max_tokens": 32, "ignore_eos": True}
    free = collections.Counter(t for o in ids(tiny.generate(PROMPT, SamplingParams(**sp))) for t in o)
    ban = [t for t, _ in free.most_common(12)]
    assert sum(free[t] for t in ban) >= 24  # the banned tokens are ones this request samples often
    outs = ids(tiny.generate(PROMPT, SamplingParams(**sp, logit_bias={t: -100 for t in ban})))
    assert not set(ban) & {t for o in outs for t in o}, outs
    again = ids(tiny.generate(PROMPT, SamplingParams(**sp, logit_bias={t: -100 for t in ban})))
    assert again == outs  # seeded: the same draws


def test_bias_acts_only_on_its_row_in_a_batch(tiny):
    prompts = [PROMPT[0], {"prompt_token_ids": [100, 101, 102]}, {"prompt_token_ids": [7] * 9}]
    plain = [SamplingParams(**GREEDY), SamplingParams(**GREEDY), SamplingParams(temperature=0.8, seed=3, max_tokens=12)]
    alone = ids(tiny.generate(prompts, plain))
    biased = SamplingParams(**GREEDY, logit_bias={alone[0][0]: -100, 300: 5.0})
    mixed = ids(tiny.generate(prompts, [biased] + plain[1:]))
    assert mixed[1:] == alone[1:]  # the rows without a bias: unchanged, greedy and seeded alike
    assert mixed[0] != alone[0] and alone[0][0] not in mixed[0]


def test_a_grammar_mask_wins_over_a_bias(tiny):
    """The bias is added to the masked logits: -inf + 100 stays -inf. A forbidden token cannot be forced; a ban
    moves the choice to another token the grammar allows."""
    regex = r"(ab|cd){3,12}"
    so = StructuredOutputsParams(regex=regex)
    sp = {"temperature": 0, "max_tokens": 24, "structured_outputs": so}
    base = tiny.generate(PROMPT, SamplingParams(**sp))[0].outputs[0]
    the = tiny.engine.tok.encode("The")[0]  # no string of the grammar contains it
    forced = tiny.generate(PROMPT, SamplingParams(**sp, logit_bias={the: 100}))[0].outputs[0]
    assert forced.token_ids == base.token_ids
    first = base.token_ids[0]
    moved = tiny.generate(PROMPT, SamplingParams(**sp, logit_bias={first: -100}))[0].outputs[0]
    assert re.fullmatch(regex, base.text) and re.fullmatch(regex, moved.text)
    assert first not in moved.token_ids and moved.text != base.text


def test_an_id_outside_the_vocabulary_is_refused_naming_the_field(tiny):
    vocab = tiny.engine.spec.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"logit_bias token ids \[{vocab}\].*\[0, {vocab}\)") as e:
        tiny.generate(PROMPT, SamplingParams(**GREEDY, logit_bias={3: 1.0, vocab: 1.0}))
    assert e.value.field == f"logit_bias.{vocab}"
    assert tiny.engine.block_manager.num_free_blocks == tiny.engine.block_manager.num_blocks  # nothing queued


# ---- speculative decoding's verification ------------------------------------------------------------------------
def test_verification_applies_the_bias_to_every_row():
    """Drafts that are the unbiased argmax: a banned one is rejected (greedy) or never accepted (sampled), and a
    request without a bias in the same batch still accepts its drafts."""
    vocab, n = 6, 400
    row = torch.tensor([3.0, 1.0, 0.5, 0.0, -1.0, 0.3])  # token 0 is everyone's argmax
    sampler = Sampler(vocab, torch.device("cpu"))
    ban = {0: -100.0}
    greedy = [
        Request("g", [1], SamplingParams(temperature=0, logit_bias=ban)),
        Request("p", [1], SamplingParams(temperature=0)),
    ]
    out, _ = verify(sampler, row.repeat(6, 1), greedy, [[0, 0], [0, 0]])
    assert out == [[1], [0, 0, 0]]  # the banned draft rejected, the target's biased argmax emitted instead
    sampled = [Request(f"s{i}", [1], SamplingParams(temperature=1.0, logit_bias=ban)) for i in range(n)]
    out, _ = verify(sampler, row.repeat(3 * n, 1), sampled, [[0, 0]] * n)
    assert all(t != 0 for o in out for t in o) and all(len(o) == 1 for o in out)


@pytest.mark.parametrize("sampled", [False, True])
def test_ngram_speculation_honours_the_bias(tiny_llama, tiny, sampled):
    """A forced token: its n-gram drafts are accepted only if verification adds the bias (the unbiased target would
    reject them). Greedy: the very tokens plain decoding gives."""
    spec = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=0, speculative_config=NGRAM)
    prompts = [PROMPT[0], {"prompt_token_ids": [7] * 10}]
    sp = (
        {"temperature": 1.0, "seed": 5, "max_tokens": 16, "ignore_eos": True}
        if sampled
        else {**GREEDY, "max_tokens": 16}
    )
    params = [SamplingParams(**sp, logit_bias={300: 100}), SamplingParams(**sp, logit_bias={300: 100, 114: -100})]
    got = ids(spec.generate(prompts, params))
    st = spec.engine.stats()
    spec.engine.shutdown()
    assert got == [[300] * 16] * 2
    assert st["spec_decode_num_accepted_tokens"] >= 8, st
    if not sampled:
        assert got == ids(tiny.generate(prompts, params))


# ---- the handler: OpenAI routes and native jobs on SmolLM2 ----------------------------------------------------
PARIS, LONDON = 7042, 4528  # SmolLM2's " Paris" and " London"


@pytest.fixture(scope="module")
def worker(smollm2_path):
    cfg = EngineConfig(model=str(smollm2_path), dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20)
    eng = AsyncEngine(cfg)
    assert eng.engine.tok.encode(" Paris") == [PARIS] and eng.engine.tok.encode(" London") == [LONDON]
    yield Worker(load_settings({}), eng)
    eng.shutdown()


def run_job(worker, inp) -> list:
    async def go():
        return [c async for c in worker.handle({"id": "t", "input": inp})]

    return asyncio.run(go())


def error_param(chunks) -> str | None:
    assert len(chunks) == 1 and "error" in chunks[0], chunks
    return json.loads(chunks[0]["error"])["param"].removeprefix("openai_input.")


def test_openai_routes_force_ban_and_refuse(worker):
    comp = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    route = {"openai_route": "/v1/completions"}
    base = run_job(worker, {**route, "openai_input": comp})[0]["choices"][0]["text"]
    banned = run_job(worker, {**route, "openai_input": {**comp, "logit_bias": {str(PARIS): -100}}})[0]
    assert base.startswith(" Paris") and not banned["choices"][0]["text"].startswith(" Paris")
    chat = {"messages": [{"role": "user", "content": "Name a city."}], "max_tokens": 3, "temperature": 0}
    body = {**chat, "logit_bias": {str(LONDON): 100}, "logprobs": True, "top_logprobs": 1}
    out = run_job(worker, {"openai_route": "/v1/chat/completions", "openai_input": body})[0]["choices"][0]
    assert out["message"]["content"] == " London" * 3
    lp = out["logprobs"]["content"][0]  # raw logprobs: the unbiased favourite is the top one
    assert lp["token"] == " London" and lp["top_logprobs"][0]["token"] != " London"
    for bias, param in (
        ({"abc": 1}, "logit_bias.abc"),
        ({"60000": 1}, "logit_bias.60000"),
        ({"1": "x"}, "logit_bias.1"),
    ):
        inp = {"openai_route": "/v1/chat/completions", "openai_input": {**chat, "logit_bias": bias}}
        assert error_param(run_job(worker, inp)) == param


def test_native_job_force_ban_and_refuse(worker):
    sp = {"temperature": 0, "max_tokens": 3}
    job = {"prompt": "The capital of France is", "sampling_params": sp}
    base = "".join(run_job(worker, job)[-1]["choices"][0]["tokens"])
    banned = run_job(worker, {**job, "sampling_params": {**sp, "logit_bias": {str(PARIS): -100}}})
    forced = run_job(worker, {**job, "sampling_params": {**sp, "logit_bias": {str(LONDON): 100}}})
    assert base.startswith(" Paris") and not "".join(banned[-1]["choices"][0]["tokens"]).startswith(" Paris")
    assert "".join(forced[-1]["choices"][0]["tokens"]) == " London" * 3
    bad = run_job(worker, {**job, "sampling_params": {**sp, "logit_bias": {"60000": 5}}})
    assert error_param(bad) == "sampling_params.logit_bias.60000"


# ---- the emulator with the real openai client -------------------------------------------------------------------
def test_openai_client_through_the_emulator(smollm2_path):
    from openai import BadRequestError, OpenAI

    from bench.procs import Emulator, emulator_env

    env = emulator_env(
        MODEL_NAME=str(smollm2_path), DTYPE="float32", MAX_MODEL_LEN="1024", KV_CACHE_MEMORY=str(64 << 20)
    )
    emu = Emulator(env)
    try:
        oai = OpenAI(base_url=emu.base_url, api_key="local", max_retries=0, timeout=120)
        kw = {"model": "x", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
        kw["model"] = oai.models.list().data[0].id
        assert oai.completions.create(**kw).choices[0].text.startswith(" Paris")
        forced = oai.completions.create(**kw, logit_bias={str(LONDON): 100}).choices[0].text
        banned = oai.completions.create(**kw, logit_bias={str(PARIS): -100}).choices[0].text
        assert forced == " London" * 3 and not banned.startswith(" Paris")
        msgs = [{"role": "user", "content": "Name a city."}]
        chat = oai.chat.completions.create(
            model=kw["model"], messages=msgs, max_tokens=2, logit_bias={str(LONDON): 100}
        )
        assert chat.choices[0].message.content == " London" * 2  # sampled (temperature 1): +100 still forces it
        with pytest.raises(BadRequestError) as e:
            oai.completions.create(**kw, logit_bias={"60000": 1})
        assert (e.value.param or "").removeprefix("openai_input.") == "logit_bias.60000", e.value.body
    finally:
        emu.close()
