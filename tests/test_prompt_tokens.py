"""A prompt's special tokens and a request's own template, in-process on the tiny llama whose tokenizer adds a BOS
(SmolLM2's adds none, so tests/test_openai_fields.py cannot show add_special_tokens acting): vLLM's
add_special_tokens (chat default false: the template writes its own BOS; completions default true), and
TRUST_REQUEST_CHAT_TEMPLATE, vLLM's opt-in for a request's chat_template."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from tokenizers import Tokenizer, processors

from engine import AsyncEngine, EngineConfig
from handler.settings import load_settings
from handler.worker import Worker


@pytest.fixture(scope="module")
def bos_worker(tiny_llama, tmp_path_factory):
    model = tmp_path_factory.mktemp("bos") / "m"
    shutil.copytree(tiny_llama, model)
    t = Tokenizer.from_file(str(model / "tokenizer.json"))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", t.token_to_id("<s>"))])
    t.save(str(model / "tokenizer.json"))
    eng = AsyncEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64, log_stats_interval=0))
    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"  # writes its own BOS
    yield Worker(load_settings({"CUSTOM_CHAT_TEMPLATE": template}), eng), t.token_to_id("<s>")
    eng.shutdown()


def test_add_special_tokens(bos_worker):
    """Chat: the template's BOS only (vLLM's default false; true adds the tokenizer's on top). Completions: the
    tokenizer's BOS (default true; false leaves it out)."""
    w, bos = bos_worker

    def prompt_ids(route, body):
        inp = {"openai_route": route, "openai_input": {"max_tokens": 1, "return_token_ids": True, **body}}
        out = asyncio.run(_collect(w, inp))[0]
        return out.get("prompt_token_ids") or out["choices"][0]["prompt_token_ids"]

    user = {"messages": [{"role": "user", "content": "The quick brown"}]}
    chat_ids = prompt_ids("/v1/chat/completions", user)
    assert chat_ids[0] == bos and chat_ids[1] != bos  # one BOS: the template's
    assert prompt_ids("/v1/chat/completions", user | {"add_special_tokens": True})[:2] == [bos, bos]
    text = {"prompt": "The quick brown"}
    assert prompt_ids("/v1/completions", text)[0] == bos
    assert prompt_ids("/v1/completions", text | {"add_special_tokens": False}) == chat_ids[1:]


def test_a_request_template_needs_trust(bos_worker):
    """Without TRUST_REQUEST_CHAT_TEMPLATE (vLLM's --trust-request-chat-template) a request's own chat_template, Jinja
    code from the client, is refused (the emulator above runs with it)."""
    w, _ = bos_worker
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages[0].content }}"}
    err = asyncio.run(_collect(w, {"openai_route": "/v1/chat/completions", "openai_input": body}))[0]["error"]
    assert "TRUST_REQUEST_CHAT_TEMPLATE" in err and '"param": "chat_template"' in err


async def _collect(w, inp):
    return [c async for c in w.handle({"id": "t", "input": inp})]
