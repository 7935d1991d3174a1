"""LoRA end to end on SmolLM2: an adapter stored in a real S3 server (moto, its own process) is named by the
`openai` client's `model` through the local Runpod emulator, and by a native job's `lora` field; the streamed text
equals HF transformers + peft (fp32)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from bench.procs import Emulator
from engine import AsyncEngine
from handler.settings import load_settings
from handler.worker import Worker
from tests.lora_fixtures import make_peft_adapter, upload_adapter
from tests.test_lora_engine import peft_greedy

pytestmark = pytest.mark.slow  # the real SmolLM2 with adapters from moto's S3 server

PROMPT = "The three primary colors are"
N = 12


@pytest.fixture(scope="module")
def smol_adapter(smollm2_path, s3, tmp_path_factory):
    """A rank-8 PEFT adapter for SmolLM2 (B std 0.1: 0.02 would not change the greedy text) in s3://smol/."""
    from transformers import AutoTokenizer

    folder, _ = make_peft_adapter(
        smollm2_path, tmp_path_factory.mktemp("smol-lora") / "tutor", r=8, alpha=16, seed=7, b_std=0.1
    )
    upload_adapter(s3, "smol", "adapters/tutor", folder)
    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    ids = tok(PROMPT).input_ids
    ref, base = peft_greedy(smollm2_path, folder, [ids], N)[0], peft_greedy(smollm2_path, None, [ids], N)[0]
    assert ref != base, "the adapter must change the greedy output, or the test could not fail"
    return tok.decode(ref), tok.decode(base)


def lora_env(smollm2_path, moto_server, tmp_path) -> dict:
    return dict(
        MODEL_NAME=str(smollm2_path),
        DTYPE="float32",
        MAX_MODEL_LEN="1024",
        HF_HUB_OFFLINE="1",
        OPENAI_SERVED_MODEL_NAME_OVERRIDE="smol",
        ENABLE_LORA="true",
        MAX_LORA_RANK="8",
        LORA_S3_URI="s3://smol/adapters/",
        S3_ENDPOINT_URL=moto_server.url,
        BASE_PATH=str(tmp_path),
    )


def test_native_job_lora_field(smollm2_path, smol_adapter, moto_server, tmp_path):
    want, base = smol_adapter
    settings = load_settings(lora_env(smollm2_path, moto_server, tmp_path))
    eng = AsyncEngine(settings.engine_config().replace(log_stats_interval=0))
    worker = Worker(settings, eng)

    def run(inp):
        async def go():
            return [c async for c in worker.handle({"id": "j", "input": inp})]

        return asyncio.run(go())

    try:
        sp = {"temperature": 0, "max_tokens": N, "ignore_eos": True}
        out = run({"prompt": PROMPT, "sampling_params": sp, "lora": "tutor"})
        assert "".join(out[-1]["choices"][0]["tokens"]) == want
        out = run({"prompt": PROMPT, "sampling_params": sp})
        assert "".join(out[-1]["choices"][0]["tokens"]) == base
        err = json.loads(
            run({"prompt": PROMPT, "sampling_params": sp, "lora": {"name": "x", "s3_uri": "s3://evil/x"}})[0]["error"]
        )
        assert err["param"] == "lora.s3_uri" and "LORA_ALLOWED_BUCKETS" in err["message"]
        models = run({"openai_route": "/v1/models"})[0]
        assert [m["id"] for m in models["data"]] == ["smol", "tutor"]
    finally:
        eng.shutdown()


def test_openai_client_streams_with_an_adapter_through_the_emulator(smollm2_path, smol_adapter, moto_server, tmp_path):
    from openai import NotFoundError, OpenAI

    want, base = smol_adapter
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_")}
    env.update(lora_env(smollm2_path, moto_server, tmp_path))  # the worker gets the AWS test credentials too
    emu = Emulator(env)
    try:
        oai = OpenAI(base_url=f"{emu.base}/openai/v1", api_key="local", max_retries=0, timeout=120)
        stream = oai.completions.create(
            model="tutor", prompt=PROMPT, max_tokens=N, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
        full = oai.completions.create(
            model="smol", prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
        )
        assert full.choices[0].text == base
        assert [m.id for m in oai.models.list().data] == ["smol", "tutor"]
        with pytest.raises(NotFoundError, match="unknown|model"):
            oai.completions.create(model="../../etc", prompt=PROMPT, max_tokens=2)
    finally:
        emu.close()
