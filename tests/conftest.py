"""Shared fixtures: the real SmolLM2 weights (converted once into the user cache) and tiny random
models of each supported architecture, saved as real HF checkpoints (built by tests/utils.py)."""

from __future__ import annotations

import os
from pathlib import Path

# Triton kernels run on CPU through the interpreter; this must be set before any @triton.jit decorator runs,
# i.e. before engine or kernels is imported. (bench/gpu_check.sh sets TRITON_INTERPRET=0 on a GPU.)
os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`make test` runs two workers on CI's two cores), each worker and the processes it starts get
# one OpenMP thread: two workers of two threads each on two cores spin-wait on descheduled peers.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest

# moto's S3 server and the PEFT adapter fixtures, for every test module that names them
pytest_plugins = ["tests.lora_fixtures"]

from engine.config import default_cache_root  # noqa: E402 - after TRITON_INTERPRET is set
from tests import triton_interp  # noqa: E402

triton_interp.install()  # the interpreter without its per-call re-patching (tests/triton_interp.py says why)
from tests.utils import TINY_ARCHS, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from engine.weights.default_model import ensure_default_model

    return ensure_default_model(Path(default_cache_root()))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]
