"""No silent no-ops, settings half (the request half is tests/test_no_silent_fields.py): every field of
handler.settings.Settings (each an environment variable) and each worker-vllm alias changes behaviour against a
baseline: the EngineConfig built, what the worker or its entry point does, a job's output, or what warmup does.
Settings.ignored() lists the combinations that do nothing (tests/test_settings.py); the walk iterates
Settings.model_fields, so a variable added without a case here fails."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine import AsyncEngine, EngineConfig
from handler import jobs
from handler.pacing import BatchSizer
from handler.settings import ALIASES, Settings, load_settings
from handler.worker import Worker

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if tools %}T{% endif %}<a>"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _run(w: Worker, inp: dict) -> list:
    async def go():
        return [c async for c in w.handle({"id": "walk", "input": inp})]

    return asyncio.run(go())


def config(s: Settings, ctx):
    return s.engine_config()


def worker(s: Settings, ctx):
    w = Worker(s, None)
    return w.served_name, w.concurrency(0)


def stream(s: Settings, ctx):
    """Tokens per yield of a streamed native job."""
    sp = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    counts = [
        c["usage"]["output"] for c in _run(Worker(s, ctx.eng), {"prompt": "The", "stream": True, "sampling_params": sp})
    ]
    return [b - a for a, b in zip([0] + counts, counts)]


def flush(s: Settings, ctx):
    """How paced() groups six one-token outputs that come 10 ms apart."""

    async def outs():
        for i in range(6):
            await asyncio.sleep(0.01)
            yield SimpleNamespace(outputs=[SimpleNamespace(delta_token_ids=[i])], finished=i == 5)

    async def go():
        return [len(g) async for g in jobs.paced(Worker(s, None).ctx, outs(), BatchSizer(1, 3, 50))]

    return asyncio.run(go())


def chat(s: Settings, ctx):
    """A chat job with a tool and no tool_choice ("auto"): its message, or its error."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "max_tokens": 3, "temperature": 0}
    out = _run(Worker(s, ctx.eng), {"openai_route": "/v1/chat/completions", "openai_input": body})[0]
    return out.get("error") or out["choices"][0]["message"]


def request_template(s: Settings, ctx):
    """A chat job with its own chat_template: the prompt it renders, or its error."""
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": TEMPLATE, "return_token_ids": True}
    out = _run(Worker(s, ctx.eng), {"openai_route": "/v1/chat/completions", "openai_input": body | {"max_tokens": 1}})
    return out[0].get("error") or out[0]["prompt_token_ids"]


def entry(s: Settings, ctx):
    """python -m handler's main(): the local no-job exit or runpod's loop, and the SIGTERM grace it installs."""
    import handler.__main__ as main_mod
    from handler import runpod_sdk

    runpod_sdk.lean_import()
    import runpod

    seen = {}
    with ctx.monkeypatch.context() as m:
        m.chdir(ctx.tmp)  # no test_input.json
        m.setattr(main_mod, "build_worker", lambda **kw: Worker(s, None))
        m.setattr(runpod_sdk, "install", lambda grace, on_expired: seen.update(grace=grace))
        m.setattr(runpod.serverless, "start", lambda config: seen.update(started=True))
        return main_mod.main([]), seen


def offline(s: Settings, ctx):
    """warmup: may a model missing from every HF cache be downloaded?"""
    from warmup.__main__ import NotReady, _may_download

    try:
        _may_download(s, s.engine_config(), RuntimeError("not in any HF cache"))
    except NotReady as e:
        return str(e)
    return "downloads"


def token(s: Settings, ctx):
    """warmup: the token its download uses."""
    import huggingface_hub

    from warmup.__main__ import _download

    got = {}
    with ctx.monkeypatch.context() as m:
        m.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: got.update(kw))
        _download(s, s.engine_config())
    return got["token"]


def triton(s: Settings, ctx):
    """Triton reads TRITON_CACHE_DIR itself; the worker's start keeps it, or moves one it cannot write."""
    import handler.settings as hs

    env = {"TRITON_CACHE_DIR": s.TRITON_CACHE_DIR}
    with ctx.monkeypatch.context() as m:
        m.setattr(hs.os, "environ", env)
        m.setattr(hs, "_limit_malloc_arenas", lambda n: None)
        hs.set_library_defaults()
    return env["TRITON_CACHE_DIR"] == s.TRITON_CACHE_DIR


def embed(s: Settings, ctx):
    """An embedding of 8 dimensions: the vector, or its error."""
    body = {"input": "The quick brown fox", "dimensions": 8}
    out = _run(Worker(s, ctx.eng), {"openai_route": "/v1/embeddings", "openai_input": body})[0]
    return out.get("error") or out["data"][0]["embedding"]


def mode(s: Settings, ctx):
    return s.endpoint_mode()


def lb_server(s: Settings, ctx):
    """The load-balancing server, in process (its worker stand-in ready): its ports, what /ping, /metrics and a
    2 KiB body get, and its admission's limits."""
    from fastapi.testclient import TestClient

    from handler import lb

    server = lb.LBServer(s)
    server.worker, server.state = SimpleNamespace(fault=None, start_error=None, unhealthy=None), "ready"
    client = TestClient(lb._Guard(lb.create_app(server), server))
    body, json_type = b"{" + b" " * 2048 + b"}", {"Content-Type": "application/json"}
    big = client.post("/v1/completions", content=body, headers=json_type)
    statuses = [client.get("/ping").status_code, client.get("/metrics").status_code, big.status_code]
    return lb.ports(s), statuses, (server.admission.waiting, server.admission.max_wait_s)


FLUSH_BY_COUNT = {"STREAM_FLUSH_MS": "3600000"}  # job yields by count alone: the same job, the same chunks
ON_RUNPOD = {"RUNPOD_WEBHOOK_GET_JOB": "http://127.0.0.1:9/job-take/$ID"}
SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'
LORA_ON = {"ENABLE_LORA": "true"}
# variable: (value, baseline env, observer); "{tmp}" is this test's tmp_path
CASES = {
    "MODEL_NAME": ("org/model", {}, config),
    "MODEL_REVISION": ("v1", {}, config),
    "TOKENIZER_NAME": ("/tok", {}, config),
    "BASE_PATH": ("{tmp}/volume", {}, config),
    "HF_HOME": ("/hf", {}, config),
    "HF_HUB_CACHE": ("/hf-hub", {}, config),
    "HF_HUB_OFFLINE": ("1", {"MODEL_NAME": "org/model"}, offline),
    "HF_TOKEN": ("hf_secret", {"MODEL_NAME": "org/model", "HF_HUB_CACHE": "{tmp}/hub"}, token),
    "TRITON_CACHE_DIR": ("{tmp}/a-file/triton", {"TRITON_CACHE_DIR": "{tmp}/triton"}, triton),
    "RUNPOD_POD_ID": ("pod", {}, config),  # on Runpod: the volume's HF cache is searched
    "LOCAL_EMULATOR": ("1", {"RUNPOD_POD_ID": "pod"}, config),  # ... but not under the emulator
    "RUNPOD_ENDPOINT_ID": ("ep", {}, config),
    "MAX_MODEL_LEN": ("512", {}, config),
    "DTYPE": ("float32", {}, config),
    "MAX_NUM_SEQS": ("8", {}, config),
    "MAX_NUM_BATCHED_TOKENS": ("512", {}, config),
    "LONG_PREFILL_TOKEN_THRESHOLD": ("64", {}, config),
    "GPU_MEMORY_UTILIZATION": ("0.5", {}, config),
    "KV_CACHE_MEMORY": ("1000000", {}, config),
    "BLOCK_SIZE": ("32", {}, config),
    "KERNEL_BACKEND": ("torch", {}, config),
    "ENFORCE_EAGER": ("false", {}, config),  # where graphs cannot run: Settings.ignored() and the engine's warning
    "MAX_CONCURRENCY": ("4", {}, worker),
    "DEFAULT_BATCH_SIZE": ("2", FLUSH_BY_COUNT, stream),
    "DEFAULT_MIN_BATCH_SIZE": ("2", FLUSH_BY_COUNT, stream),
    "DEFAULT_BATCH_SIZE_GROWTH_FACTOR": ("2", FLUSH_BY_COUNT, stream),
    "SHUTDOWN_GRACE_S": ("3", ON_RUNPOD, entry),
    "STREAM_FLUSH_MS": ("1", FLUSH_BY_COUNT, flush),
    "OPENAI_SERVED_MODEL_NAME_OVERRIDE": ("mine", {}, worker),
    "CUSTOM_CHAT_TEMPLATE": (
        TEMPLATE,
        {"ENABLE_AUTO_TOOL_CHOICE": "true", "TOOL_CALL_PARSER": "hermes"},
        chat,
    ),  # the tiny model has no template of its own
    "TRUST_REQUEST_CHAT_TEMPLATE": ("true", {}, request_template),
    "RUNPOD_WEBHOOK_GET_JOB": (ON_RUNPOD["RUNPOD_WEBHOOK_GET_JOB"], {}, entry),
    "QUANTIZATION": ("fp8", {}, config),
    "KV_CACHE_DTYPE": ("fp8", {}, config),
    "ENABLE_PREFIX_CACHING": ("false", {}, config),
    "SPECULATIVE_CONFIG": (SPEC, {}, config),
    "TENSOR_PARALLEL_SIZE": ("2", {}, config),
    "ENABLE_AUTO_TOOL_CHOICE": ("true", {"CUSTOM_CHAT_TEMPLATE": TEMPLATE, "TOOL_CALL_PARSER": "hermes"}, chat),
    "TOOL_CALL_PARSER": ("hermes", {"CUSTOM_CHAT_TEMPLATE": TEMPLATE, "ENABLE_AUTO_TOOL_CHOICE": "true"}, chat),
    "ENABLE_LORA": ("true", {}, config),
    "MAX_LORAS": ("2", LORA_ON, config),
    "MAX_LORA_RANK": ("8", LORA_ON, config),
    "LORA_MODULES": ('{"name": "a", "path": "/adapters/a"}', LORA_ON, config),
    "LORA_S3_URI": ("s3://bucket/adapters/", LORA_ON, config),
    "LORA_ALLOWED_BUCKETS": ("bucket", LORA_ON, config),
    "S3_ENDPOINT_URL": ("http://127.0.0.1:9", LORA_ON, config),
    "LORA_CACHE_BYTES": ("1000000", LORA_ON, config),
    "LORA_LOAD_TIMEOUT_S": ("5", LORA_ON, config),
    "RUNPOD_ENDPOINT_TYPE": ("lb", {}, mode),
    "PORT": ("8080", {}, mode),
    "PORT_HEALTH": ("8081", {"PORT": "8080"}, lb_server),
    "HEALTH_CHECK_PATH": ("/healthz", {}, lb_server),
    "API_KEY": ("k", {}, lb_server),
    "MAX_REQUEST_BYTES": ("1024", {}, lb_server),
    "LB_MAX_WAITING": ("3", {}, lb_server),
    "LB_MAX_WAIT_S": ("5", {}, lb_server),
    "REASONING_PARSER": (
        "qwen3",
        {"CUSTOM_CHAT_TEMPLATE": TEMPLATE, "ENABLE_AUTO_TOOL_CHOICE": "true", "TOOL_CALL_PARSER": "hermes"},
        chat,
    ),  # the tiny model never writes </think>: all of its reply is reasoning
    "POOLING": ("mean", {"IS_MATRYOSHKA": "true"}, embed),
    "NORMALIZE": ("false", {"IS_MATRYOSHKA": "true"}, embed),
    "IS_MATRYOSHKA": ("true", {}, embed),  # without it: dimensions refused
    "STEP_TIMEOUT_S": ("60", {}, config),  # what each does: tests/test_faults.py and tests/test_chaos.py
    "FAULT_INJECTION": ("nan@1", {}, config),
}
ALIAS_CASES = {
    "MIN_BATCH_SIZE": ("2", FLUSH_BY_COUNT, stream),
    "BATCH_SIZE_GROWTH_FACTOR": ("2", FLUSH_BY_COUNT, stream),
}


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=0))
    yield eng
    eng.shutdown()


def test_every_setting_changes_behaviour(tiny_engine, tmp_path, monkeypatch):
    missing = set(Settings.model_fields) - set(CASES)
    assert not missing, f"settings with no case: {sorted(missing)}"
    assert set(CASES) == set(Settings.model_fields) and set(ALIAS_CASES) == set(ALIASES)
    (tmp_path / "a-file").write_text("")  # a path under a regular file can never be created, even by root
    ctx = SimpleNamespace(eng=tiny_engine, monkeypatch=monkeypatch, tmp=tmp_path)
    for name, (value, base, observer) in {**CASES, **ALIAS_CASES}.items():
        base = {k: v.replace("{tmp}", str(tmp_path)) for k, v in base.items()}
        env = {**base, name: value.replace("{tmp}", str(tmp_path))}
        before, after = observer(load_settings(base), ctx), observer(load_settings(env), ctx)
        assert before != after, f"{name}={env[name]!r} changed nothing that {observer.__name__}() sees: {after!r}"


def test_a_budget_for_the_other_device_is_logged(tiny_llama, caplog):
    """GPU_MEMORY_UTILIZATION does nothing on CPU (the pool is KV_CACHE_MEMORY): the start says so, at WARNING."""
    import logging

    from engine import LLM

    with caplog.at_level(logging.WARNING, logger="engine"):
        LLM(str(tiny_llama), gpu_memory_utilization=0.5, kv_cache_memory=1 << 22, log_stats_interval=0)
        LLM(str(tiny_llama), kv_cache_memory=1 << 22, log_stats_interval=0)  # the default: nothing to say
    lines = [r for r in caplog.records if "GPU_MEMORY_UTILIZATION is ignored" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
