"""LoRA test fixtures: a real S3 endpoint (moto's server in its own process, on 127.0.0.1) that counts requests on
the server side, and real PEFT adapters for the tiny models of tests/utils.py.

Requests are counted from the server's own access log (werkzeug writes one line per request before the response
body), so a cache cannot fake a hit: a GET it made shows up there whatever the client does."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from bench.procs import MotoServer


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    # Dummy credentials for this process only; the server process gets none (moto does not check them).
    with pytest.MonkeyPatch.context() as mp:
        for k, v in dict(
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_SESSION_TOKEN="testing",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_CONFIG_FILE=os.devnull,
            AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        ).items():
            mp.setenv(k, v)
        server = MotoServer(tmp_path_factory.mktemp("moto") / "server.log")
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="session")
def s3(moto_server):
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=moto_server.url)


def upload_adapter(
    s3, bucket: str, prefix: str, folder: Path, files=("adapter_config.json", "adapter_model.safetensors")
) -> str:
    """Put `files` of `folder` under s3://bucket/prefix/ (bucket created if needed); returns the URI."""
    try:
        s3.create_bucket(Bucket=bucket)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    prefix = prefix.rstrip("/") + "/"
    for f in files:
        s3.put_object(Bucket=bucket, Key=prefix + f, Body=(Path(folder) / f).read_bytes())
    return f"s3://{bucket}/{prefix}"


def make_peft_adapter(
    base: Path,
    out: Path,
    *,
    r: int = 4,
    alpha: float = 8,
    rslora: bool = False,
    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    seed: int = 0,
    b_std: float = 0.1,
    **lora_kwargs,
):
    """A real PEFT adapter: get_peft_model + random non-zero A and B + save_pretrained.

    Returns (folder, expected) where expected = {"scaling": PEFT's own scaling, "weights": {(layer, module):
    (A, B)}} read from PEFT's modules, not from the file."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    targets = list(targets) if not isinstance(targets, str) else targets
    pm = get_peft_model(
        model,
        LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0, **lora_kwargs),
    )
    g = torch.Generator().manual_seed(seed)
    weights, scaling = {}, set()
    with torch.no_grad():
        for name, mod in pm.named_modules():
            if not hasattr(mod, "lora_A") or "default" not in getattr(mod, "lora_A", {}):
                continue
            a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight  # [r, in], [out, r]
            a.copy_(torch.randn(a.shape, generator=g) * 0.1)
            b.copy_(torch.randn(b.shape, generator=g) * b_std)
            m = re.search(r"layers\.(\d+)\.\w+\.(\w+)$", name)
            if m:
                weights[(int(m[1]), m[2])] = (a.detach().clone(), b.detach().clone())
            scaling.add(mod.scaling["default"])
    pm.save_pretrained(str(out))
    assert len(scaling) == 1, scaling
    return Path(out), {"scaling": scaling.pop(), "weights": weights}


def model_spec(base: Path):
    from engine.models.spec import ModelSpec

    return ModelSpec.from_hf(json.loads((Path(base) / "config.json").read_text()))


@pytest.fixture(scope="session")
def lora_bases(tmp_path_factory) -> dict[str, Path]:
    """Tiny llama (head_dim = hidden/heads) and qwen3 (head_dim 48 != hidden/heads): only the two we need."""
    from tests.utils import build_tiny_model

    root = tmp_path_factory.mktemp("lora-base")
    return {arch: build_tiny_model(root / arch, arch) for arch in ("llama", "qwen3")}
