"""vLLM's /tokenize and /detokenize (handler/openai_tokenize.py) as OpenAI-route jobs, on a tiny model: the same ids
the completion routes give their prompts, the round trip back to text, and errors naming the field."""

from __future__ import annotations

import json

import pytest

from engine import AsyncEngine, EngineConfig
from handler.settings import load_settings
from handler.worker import Worker
from tests.test_handler_jobs import error_of, run_job

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)
CHAT = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def worker(tiny_llama):
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=0))
    yield Worker(load_settings({"CUSTOM_CHAT_TEMPLATE": TEMPLATE}), eng)
    eng.shutdown()


def _route(worker, route: str, body: dict):
    chunks = run_job(worker, {"openai_route": route, "openai_input": body})
    return error_of(chunks) or chunks[0]


def test_tokenize_gives_the_ids_the_completion_routes_use(worker):
    prompt = "The quick brown fox"
    out = _route(worker, "/tokenize", {"prompt": prompt, "return_token_strs": True})
    assert out["tokens"] == worker.engine.tok.encode(prompt) and out["count"] == len(out["tokens"])
    assert "".join(out["token_strs"]).replace("<s>", "") == prompt and out["max_model_len"] == 512
    comp = _route(worker, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "return_token_ids": True})
    assert comp["choices"][0]["prompt_token_ids"] == out["tokens"]
    chat = _route(worker, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "return_token_ids": True})
    tok = _route(worker, "/tokenize", {"messages": CHAT})
    assert tok["tokens"] == chat["prompt_token_ids"]  # the same template, the same ids
    no_prompt = _route(worker, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert no_prompt["tokens"] == worker.engine.tok.encode("<user>Hello world!", add_special_tokens=False)
    back = _route(worker, "/detokenize", {"tokens": out["tokens"]})
    assert back["prompt"].replace("<s>", "") == prompt


def test_bad_requests_name_the_field(worker):
    err = _route(worker, "/tokenize", {"prompt": "a", "messages": CHAT})
    assert "exactly one of prompt and messages" in err["message"]
    err = _route(worker, "/tokenize", {"prompt": "a", "add_generation_promt": True})
    assert err["param"] == "add_generation_promt"  # paths in the client's own body
    err = _route(worker, "/detokenize", {"tokens": [5, 10**6]})
    assert err["param"] == "tokens.1" and "vocabulary" in err["message"]
    err = _route(worker, "/detokenize", {"tokens": [5], "model": "other"})
    assert err["param"] == "model" and err["code"] == "model_not_found"
    err = _route(worker, "/tokenize", {"messages": CHAT, "chat_template": "{{ x }}"})
    assert err["param"] == "chat_template" and "TRUST_REQUEST_CHAT_TEMPLATE" in err["message"]
    assert json.dumps(err)  # an error object, not a crash
