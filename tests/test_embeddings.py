"""Embeddings (engine/pooling.py, handler/openai_embeddings.py): each pooling equals HF transformers' pooled
last_hidden_state (fp32, cosine >= 0.9999) on tiny random models of every family and on the bundled SmolLM2, with
prompts chunked, mixed into steps with generation, preempted and prefix-cached; then /v1/embeddings through the
real Worker (every field) and through the `openai` client on a load-balancing worker."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from engine import LLM, AsyncEngine, EngineConfig, PoolingParams, SamplingParams
from engine.pooling import model_pooling
from handler.settings import load_settings
from handler.worker import Worker
from tests.test_handler_jobs import error_of, run_job
from tests.utils import TINY_ARCHS

TEXTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b): return a + b",
    "A long sentence that spans several prefill chunks when the token budget is small, as a long document does.",
]


def hf_pooled(path, texts: list[str], pooling: str, normalize: bool = True) -> list[torch.Tensor]:
    """HF transformers' base model (AutoModel: last_hidden_state, after the final norm), pooled per text."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for t in texts:
            h = model(tok(t, return_tensors="pt").input_ids).last_hidden_state[0]
            v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
            out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return out


def assert_close(ours: list[list[float]], ref: list[torch.Tensor]) -> None:
    assert len(ours) == len(ref)
    for v, r in zip(ours, ref):
        v = torch.tensor(v)
        assert v.shape == r.shape
        assert torch.nn.functional.cosine_similarity(v, r, dim=0) >= 0.9999
        assert torch.allclose(v.norm(), r.norm(), rtol=1e-3)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_pooling_matches_hf_on_every_family(tiny_models, arch):
    """Chunked (8 tokens a step) and batched with a generating request in the same steps."""
    llm = LLM(str(tiny_models[arch]), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8,
              log_stats_interval=0)  # fmt: skip
    try:
        for pooling in ("last", "mean", "cls"):
            emb = SamplingParams(max_tokens=1, pooling=PoolingParams(pooling))
            gen = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            outs = llm.generate([*TEXTS, "Hello there"], [emb] * len(TEXTS) + [gen])
            assert len(outs[-1].outputs[0].token_ids) == 6 and outs[-1].embedding is None
            assert all(o.outputs[0].token_ids == [] and o.finished for o in outs[:-1])  # nothing sampled
            assert_close([o.embedding for o in outs[:-1]], hf_pooled(tiny_models[arch], TEXTS, pooling))
        raw = llm.embed(TEXTS[:1], PoolingParams("mean", normalize=False))
        assert_close(raw, hf_pooled(tiny_models[arch], TEXTS[:1], "mean", normalize=False))
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_smollm2_matches_hf(smollm2_path):
    llm = LLM(str(smollm2_path), dtype="float32", max_num_batched_tokens=16, log_stats_interval=0)
    try:
        for pooling in ("last", "mean"):
            assert_close(llm.embed(TEXTS, PoolingParams(pooling)), hf_pooled(smollm2_path, TEXTS, pooling))
    finally:
        llm.engine.shutdown()


def test_preempted_cached_and_full_context_embeddings(tiny_llama):
    """A pool too small for the batch preempts (mean pooling must not count a recomputed chunk twice); a repeated
    prompt hits the prefix cache with last pooling and not with mean; a prompt that fills the context embeds; and
    every block comes back."""
    ids = [[(7 * i + j) % 200 + 5 for j in range(60)] for i in range(6)]
    prompts = [{"prompt_token_ids": p} for p in ids]
    roomy = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, log_stats_interval=0, enable_prefix_caching=False)
    tight = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=12, max_model_len=64, max_num_batched_tokens=64,
                long_prefill_token_threshold=16,
                log_stats_interval=0)  # fmt: skip
    try:
        for pooling in ("mean", "cls", "last"):
            want = roomy.embed(prompts, PoolingParams(pooling))
            before = tight.engine.scheduler.num_preemptions
            got = tight.embed(prompts, PoolingParams(pooling))
            assert tight.engine.scheduler.num_preemptions > before
            assert_close(got, [torch.tensor(w) for w in want])
        stats = tight.engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        full = tight.embed([{"prompt_token_ids": ids[0][:64]}])  # max_model_len tokens: nothing to generate
        assert len(full[0]) == tight.engine.facts.spec.hidden_size
        for pooling, cached in (("last", True), ("mean", False)):
            again = tight.generate(prompts[:1] * 2, SamplingParams(max_tokens=1, pooling=PoolingParams(pooling)))
            second = tight.generate(prompts[:1], SamplingParams(max_tokens=1, pooling=PoolingParams(pooling)))[0]
            assert (second.metrics.cached_prompt_tokens > 0) == cached, pooling
            assert_close([second.embedding], [torch.tensor(again[0].embedding)])
    finally:
        roomy.engine.shutdown()
        tight.engine.shutdown()


def test_sentence_transformers_files_choose_the_pooling(tmp_path, tiny_llama):
    import shutil

    model = tmp_path / "st"
    shutil.copytree(tiny_llama, model)
    assert model_pooling(model) == model_pooling(tiny_llama)
    assert (model_pooling(model).pooling, model_pooling(model).normalize) == ("last", True)
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))  # fmt: skip
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert (model_pooling(model).pooling, model_pooling(model).normalize) == ("mean", False)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    assert model_pooling(model).matryoshka == [16, 32]
    engine = AsyncEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64, log_stats_interval=0))
    try:  # the route follows the files: mean pooling, not normalized, 32 of 64 values
        worker = Worker(load_settings({}), engine)
        out = _embed(worker, input=TEXTS[0], dimensions=32)
        ref = hf_pooled(model, TEXTS[:1], "mean", normalize=False)[0][:32]
        assert_close([out["data"][0]["embedding"]], [ref])
        assert error_of(run_job(worker, _job(input="x", dimensions=24)))["param"] == "dimensions"
    finally:
        engine.shutdown()


# ---- /v1/embeddings through the Worker ----------------------------------------------------------------------------
def same(a, b) -> bool:
    """Equal but for float rounding (a repeated prompt's prefix comes from the cache: the same values, summed in
    another order)."""
    return np.allclose(a, b, atol=1e-5)


def _job(**body) -> dict:
    return {"openai_route": "/v1/embeddings", "openai_input": body}


def _embed(worker, **body) -> dict:
    chunks = run_job(worker, _job(**body))
    assert len(chunks) == 1 and "error" not in chunks[0], chunks
    return chunks[0]


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=128, max_model_len=256,
                                      log_stats_interval=0))  # fmt: skip
    yield engine
    engine.shutdown()


def test_every_field_of_the_route(tiny_engine, tiny_llama):
    worker = Worker(load_settings({}), tiny_engine)
    ids = tiny_engine.tok.encode(TEXTS[0])
    base = _embed(worker, input=TEXTS[0])
    assert base["object"] == "list" and base["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}
    assert base["data"][0]["object"] == "embedding" and base["data"][0]["index"] == 0
    vec = base["data"][0]["embedding"]
    assert_close([vec], hf_pooled(tiny_llama, TEXTS[:1], "last"))
    # input: a list of texts, token ids, lists of token ids (the same vectors)
    many = _embed(worker, input=[TEXTS[0], TEXTS[1]])
    assert [d["index"] for d in many["data"]] == [0, 1] and same(many["data"][0]["embedding"], vec)
    assert same(_embed(worker, input=ids)["data"][0]["embedding"], vec)
    assert same(_embed(worker, input=[ids, ids[:5]])["data"][0]["embedding"], vec)
    # encoding_format base64: little-endian float32 bytes
    b64 = _embed(worker, input=TEXTS[0], encoding_format="base64")["data"][0]["embedding"]
    assert same(np.frombuffer(base64.b64decode(b64), dtype="<f4"), vec)
    # normalize, truncate_prompt_tokens, add_special_tokens (the tiny tokenizer adds no BOS: the same ids)
    raw = _embed(worker, input=TEXTS[0], normalize=False)["data"][0]["embedding"]
    assert abs(np.linalg.norm(raw) - 1) > 1e-3 and np.allclose(np.asarray(raw) / np.linalg.norm(raw), vec, atol=1e-5)
    cut = _embed(worker, input=TEXTS[0], truncate_prompt_tokens=4)
    assert cut["usage"]["prompt_tokens"] == 4
    assert same(cut["data"][0]["embedding"], _embed(worker, input=ids[-4:])["data"][0]["embedding"])
    assert _embed(worker, input=TEXTS[0], add_special_tokens=False)["usage"]["prompt_tokens"] == len(
        tiny_engine.tok.encode(TEXTS[0], add_special_tokens=False))  # fmt: skip
    # messages (vLLM's chat form): the chat template's rendering, embedded
    chat = Worker(load_settings({"CUSTOM_CHAT_TEMPLATE": "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                                                         "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"}),
                  tiny_engine)  # fmt: skip
    msgs = [{"role": "user", "content": "hi there"}]
    for gen in (False, True):
        rendered = run_job(chat, {"openai_route": "/tokenize", "openai_input": {
            "messages": msgs, "add_generation_prompt": gen}})[0]["tokens"]  # fmt: skip
        by_msgs = _embed(chat, messages=msgs, **({"add_generation_prompt": True} if gen else {}))
        assert by_msgs["usage"]["prompt_tokens"] == len(rendered)
        assert same(by_msgs["data"][0]["embedding"], _embed(chat, input=rendered)["data"][0]["embedding"])
    # settings: POOLING, NORMALIZE, IS_MATRYOSHKA
    mean = _embed(Worker(load_settings({"POOLING": "mean", "NORMALIZE": "false"}), tiny_engine), input=TEXTS[0])
    assert_close([mean["data"][0]["embedding"]], hf_pooled(tiny_llama, TEXTS[:1], "mean", normalize=False))
    short = _embed(Worker(load_settings({"IS_MATRYOSHKA": "true"}), tiny_engine), input=TEXTS[0], dimensions=8)
    v8 = short["data"][0]["embedding"]
    assert len(v8) == 8 and abs(np.linalg.norm(v8) - 1) < 1e-5  # truncated, then normalized


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": "x", "dimensions": 8}, "dimensions", "Matryoshka"),
        ({"input": []}, "input", "empty"),
        ({"input": ""}, "input", "empty"),
        ({"input": ["ok", ""]}, "input.1", "empty"),
        ({"input": [[1, 2], [10**9]]}, "input.1", "prompt_token_ids"),
        ({"input": "x" * 3000}, "input", "max_model_len"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": "x", "model": "other"}, "model", "not served"),
        ({"input": "x", "pooling": "mean"}, "pooling", "unknown field"),
        ({}, None, "exactly one of input and messages"),
        ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, None, "exactly one"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", ""),
    ],
)
def test_bad_inputs_name_their_field(tiny_engine, body, param, words):
    err = error_of(run_job(Worker(load_settings({}), tiny_engine), _job(**body)))
    assert err is not None and err["param"] == param and words in err["message"], err
    stats = tiny_engine.stats()
    assert stats["running"] == 0


def test_dimensions_past_the_hidden_size_are_refused(tiny_engine):
    worker = Worker(load_settings({"IS_MATRYOSHKA": "true"}), tiny_engine)
    err = error_of(run_job(worker, _job(input="x", dimensions=tiny_engine.hidden_size + 1)))
    assert err["param"] == "dimensions" and str(tiny_engine.hidden_size) in err["message"]


# ---- through the openai client on a load-balancing worker ---------------------------------------------------------
@pytest.mark.slow
def test_openai_client_on_a_load_balancing_worker(smollm2_path):
    import openai

    from bench.procs import LBWorker, emulator_env

    w = LBWorker(emulator_env(DTYPE="float32", OPENAI_SERVED_MODEL_NAME_OVERRIDE="smol"))
    try:
        oai = openai.OpenAI(base_url=w.base_url, api_key="x", max_retries=0, timeout=120)
        got = oai.embeddings.create(model="smol", input=TEXTS)  # the SDK asks for base64 and decodes it
        assert [d.index for d in got.data] == [0, 1, 2] and got.usage.prompt_tokens > 10
        assert_close([d.embedding for d in got.data], hf_pooled(smollm2_path, TEXTS, "last"))
        floats = oai.embeddings.create(model="smol", input=TEXTS[0], encoding_format="float")
        assert np.allclose(floats.data[0].embedding, got.data[0].embedding, atol=1e-6)
        with pytest.raises(openai.BadRequestError) as e:
            oai.embeddings.create(model="smol", input="x", dimensions=64)
        assert e.value.body["param"] == "dimensions" or "dimensions" in e.value.body["param"]
        chat = oai.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert chat.choices[0].message.content  # the same model still chats
    finally:
        w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_base_model_checkpoint_serves_embeddings_only(tmp_path, tiny_models, arch):
    """How Qwen3-Embedding and most embedding models ship: AutoModel's class (`Qwen3Model`), its tensors without the
    "model." prefix, no lm_head. It loads, embeds as HF's AutoModel does, and refuses to generate, naming why."""
    import shutil

    import transformers

    from engine import InvalidRequestError

    src, base = tiny_models[arch], tmp_path / "base"
    transformers.AutoModel.from_pretrained(str(src), dtype=torch.float32).save_pretrained(str(base))
    for f in src.glob("tokenizer*"):
        shutil.copy(f, base)
    assert json.loads((base / "config.json").read_text())["architectures"][0].endswith("Model")
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    try:
        assert_close(llm.embed(TEXTS), hf_pooled(base, TEXTS, "last"))
        with pytest.raises(InvalidRequestError, match="embeddings only") as e:
            llm.generate("Hello", SamplingParams(max_tokens=2))
        assert e.value.field == "model"
    finally:
        llm.engine.shutdown()


def test_embeddings_beside_speculative_decoding(tiny_llama):
    """An embedding whose last chunk is one token is not a decode: it gets no lookahead slots, even with
    max_tokens left at its default."""
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, log_stats_interval=0,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    try:
        ids = [5, 6, 7, 8] * 4 + [5]  # 17 tokens: the last chunk is the one token left, which n-gram would extend
        outs = llm.generate([{"prompt_token_ids": ids}] * 2, [SamplingParams(pooling=PoolingParams()),
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])  # fmt: skip
        plain = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
        assert_close([outs[0].embedding], [torch.tensor(plain.embed([{"prompt_token_ids": ids}])[0])])
        assert len(outs[1].outputs[0].token_ids) == 8
        plain.engine.shutdown()
    finally:
        llm.engine.shutdown()
