"""handler/settings.py: worker-vllm env names -> a frozen EngineConfig; bad values name the variable."""

from __future__ import annotations

import pytest

from engine.config import default_cache_root, writable_dir
from handler.settings import SettingsError, load_settings


def test_defaults_locally_and_on_runpod():
    local = load_settings({})
    cfg = local.engine_config()
    assert cfg.model is None and cfg.dtype == "auto" and ".cache" in cfg.cache_root
    pod = load_settings({"RUNPOD_POD_ID": "abc", "MODEL_NAME": "org/m", "MAX_MODEL_LEN": "4096", "DTYPE": "half"})
    cfg = pod.engine_config()
    assert cfg.model == "org/m" and cfg.max_model_len == 4096 and cfg.dtype == "float16"
    # the volume when this user may write it (root here), else the user cache (test_cache_root_falls_back)
    assert cfg.cache_root == ("/runpod-volume" if writable_dir("/runpod-volume") else default_cache_root())
    assert "/runpod-volume/huggingface-cache/hub" in cfg.hf_cache_dirs  # read either way
    emulated = load_settings({"RUNPOD_POD_ID": "local-worker", "LOCAL_EMULATOR": "1"})  # handler.local's worker
    assert not emulated.on_runpod and emulated.engine_config().cache_root == default_cache_root()
    assert load_settings({"BASE_PATH": "/vol", "HF_HOME": "/hf"}).engine_config().hf_cache_dirs[:2] == (
        "/hf/hub",
        "/vol/huggingface-cache/hub",
    )


def test_cache_root_falls_back_when_the_volume_cannot_be_written(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a path under a regular file can never be created, even by root
    with caplog.at_level("WARNING", logger="handler"):
        cfg = load_settings({"BASE_PATH": str(blocker / "volume"), "RUNPOD_POD_ID": "abc"}).engine_config()
    assert cfg.cache_root == default_cache_root() and "cannot be written" in caplog.text
    assert str(blocker / "volume" / "huggingface-cache" / "hub") in cfg.hf_cache_dirs  # still searched for models
    assert writable_dir(tmp_path / "new" / "deeper") and not writable_dir(blocker / "x")


@pytest.mark.parametrize(
    "env,name",
    [
        ({"MAX_MODEL_LEN": "lots"}, "MAX_MODEL_LEN"),
        ({"MAX_NUM_SEQS": "0"}, "MAX_NUM_SEQS"),
        ({"GPU_MEMORY_UTILIZATION": "1.5"}, "GPU_MEMORY_UTILIZATION"),
        ({"DTYPE": "int4"}, "DTYPE"),
    ],
)
def test_invalid_values_name_the_variable(env, name):
    with pytest.raises(SettingsError, match=name):
        load_settings(env)


def test_every_documented_variable_is_parsed():
    """docs/configuration.md lists each variable; each one must reach the settings."""
    import re
    from pathlib import Path

    from handler.settings import LIBRARY_DEFAULTS, Settings

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]{2,})`", doc)) - {"RUNPOD_POD_ID", "RUNPOD_ENDPOINT_ID"}
    known = set(Settings.model_fields) | {"MIN_BATCH_SIZE", "BATCH_SIZE_GROWTH_FACTOR"} | set(LIBRARY_DEFAULTS)
    assert documented <= known, documented - known
    undocumented = (
        set(Settings.model_fields) - documented - {"RUNPOD_POD_ID", "RUNPOD_ENDPOINT_ID", "RUNPOD_WEBHOOK_GET_JOB"}
    )
    assert not undocumented, undocumented


def test_job_variables_and_worker_vllm_aliases():
    s = load_settings(
        {
            "MAX_CONCURRENCY": "8",
            "DEFAULT_BATCH_SIZE": "20",
            "MIN_BATCH_SIZE": "2",
            "BATCH_SIZE_GROWTH_FACTOR": "2.5",
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "my-model",
            "CUSTOM_CHAT_TEMPLATE": "{{ messages[0]['content'] }}",
            "ENABLE_PREFIX_CACHING": "false",
            "MAX_NUM_SEQS": "16",
            "MAX_NUM_BATCHED_TOKENS": "512",
            "KV_CACHE_MEMORY": "1000000",
            "BLOCK_SIZE": "32",
            "TOKENIZER_NAME": "/tok",
            "MODEL_REVISION": "v1",
        }
    )
    assert (s.MAX_CONCURRENCY, s.DEFAULT_BATCH_SIZE, s.DEFAULT_MIN_BATCH_SIZE) == (8, 20, 2)
    assert s.DEFAULT_BATCH_SIZE_GROWTH_FACTOR == 2.5 and s.ENABLE_PREFIX_CACHING is False
    cfg = s.engine_config()
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.kv_cache_memory, cfg.block_size) == (16, 512, 10**6, 32)
    assert (cfg.tokenizer, cfg.revision) == ("/tok", "v1")
    # the documented DEFAULT_* name wins over worker-vllm's alias
    assert load_settings({"MIN_BATCH_SIZE": "2", "DEFAULT_MIN_BATCH_SIZE": "4"}).DEFAULT_MIN_BATCH_SIZE == 4
    assert load_settings({"MODEL_NAME": "  "}).MODEL_NAME is None
    assert load_settings({"QUANTIZATION": "fp8", "KV_CACHE_DTYPE": "fp8"}).ignored() == []
    fp8 = load_settings({"QUANTIZATION": "fp8", "KV_CACHE_DTYPE": "fp8"}).engine_config()
    assert (fp8.quantization, fp8.kv_cache_dtype) == ("fp8", "fp8")
    assert load_settings({"ENABLE_LORA": "true"}).ignored() == []
    assert load_settings({"LORA_MODULES": '{"name": "a", "path": "/x"}'}).ignored() == [
        "LORA_MODULES (ignored unless ENABLE_LORA=true)"
    ]
    # worker-vllm's speculative decoding and tensor parallelism reach the engine; bad values name the variable
    assert load_settings({"TENSOR_PARALLEL_SIZE": "2"}).engine_config().tensor_parallel_size == 2
    with pytest.raises(SettingsError, match="TENSOR_PARALLEL_SIZE"):
        load_settings({"TENSOR_PARALLEL_SIZE": "0"})
    with pytest.raises(SettingsError, match=r"SPECULATIVE_CONFIG: speculative_config.num_speculative_tokens"):
        load_settings({"SPECULATIVE_CONFIG": '{"method": "ngram"}'}).engine_config()
    assert load_settings({"TENSOR_PARALLEL_SIZE": "1"}).ignored() == []
    lora = load_settings(
        {
            "ENABLE_LORA": "1",
            "MAX_LORAS": "4",
            "LORA_MODULES": '[{"name": "a", "path": "s3://b/a"}]',
            "LORA_ALLOWED_BUCKETS": "b,c",
            "S3_ENDPOINT_URL": "http://127.0.0.1:9",
        }
    ).engine_config()
    assert (lora.enable_lora, lora.max_loras, lora.lora_modules, lora.lora_allowed_buckets, lora.s3_endpoint_url) == (
        True,
        4,
        (("a", "s3://b/a"),),
        ("b", "c"),
        "http://127.0.0.1:9",
    )
    with pytest.raises(SettingsError, match="LORA_MODULES"):
        load_settings({"LORA_MODULES": '[{"name": "a"}]'})
    with pytest.raises(SettingsError, match="QUANTIZATION"):
        load_settings({"QUANTIZATION": "bitsandbytes"}).engine_config()
    assert load_settings({"QUANTIZATION": "awq_marlin"}).engine_config().quantization == "awq_marlin"  # vLLM's name


def test_enforce_eager_false_where_graphs_cannot_run_is_listed_as_ignored():
    """CUDA graphs need one GPU and the Triton kernels: where the settings alone say they cannot run,
    ENFORCE_EAGER=false is listed (and logged at start); the engine logs the no-CUDA case itself."""
    assert load_settings({"ENFORCE_EAGER": "false"}).ignored() == []  # graphs possible on a GPU
    assert load_settings({"TENSOR_PARALLEL_SIZE": "2", "KERNEL_BACKEND": "torch"}).ignored() == []  # eager anyway
    tp = load_settings({"ENFORCE_EAGER": "false", "TENSOR_PARALLEL_SIZE": "2"}).ignored()
    assert len(tp) == 1 and tp[0].startswith("ENFORCE_EAGER=false") and "TENSOR_PARALLEL_SIZE" in tp[0]
    torch_ = load_settings({"ENFORCE_EAGER": "false", "KERNEL_BACKEND": "torch"}).ignored()
    assert len(torch_) == 1 and torch_[0].startswith("ENFORCE_EAGER=false") and "KERNEL_BACKEND=torch" in torch_[0]


@pytest.mark.parametrize(
    "env,name",
    [
        ({"MAX_CONCURRENCY": "0"}, "MAX_CONCURRENCY"),
        ({"MIN_BATCH_SIZE": "zero"}, "MIN_BATCH_SIZE"),
        ({"BATCH_SIZE_GROWTH_FACTOR": "0.5"}, "BATCH_SIZE_GROWTH_FACTOR"),
        ({"ENABLE_LORA": "maybe"}, "ENABLE_LORA"),
        ({"KV_CACHE_MEMORY": "-1"}, "KV_CACHE_MEMORY"),
        ({"MAX_LORA_RANK": "x"}, "MAX_LORA_RANK"),
    ],
)
def test_more_invalid_values(env, name):
    with pytest.raises(SettingsError, match=name):
        load_settings(env)


def test_engine_level_error_names_the_variable():
    with pytest.raises(SettingsError, match="BLOCK_SIZE"):
        load_settings({"BLOCK_SIZE": "7"}).engine_config()


def test_engine_variables_are_the_engine_config_fields():
    """Each engine knob is declared once, in EngineConfig: its variable takes the field's name (upper-cased, or
    worker-vllm's), default and checks; a variable set to a value EngineConfig refuses fails at load."""
    import dataclasses

    from engine import EngineConfig
    from handler.settings import ENGINE_FIELDS, ENV_NAMES, NOT_VARIABLES, Settings

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(ENGINE_FIELDS.values()) == names - set(NOT_VARIABLES) and set(ENV_NAMES) <= names
    assert ENGINE_FIELDS["MODEL_NAME"] == "model" and ENGINE_FIELDS["MAX_NUM_SEQS"] == "max_num_seqs"
    default = EngineConfig()
    for env, field in ENGINE_FIELDS.items():
        assert Settings.model_fields[env].default == getattr(default, field), env
    for env in ({"MAX_LORAS": "0"}, {"LORA_S3_URI": "http://x"}, {"SPECULATIVE_CONFIG": "{not json"}):
        with pytest.raises(SettingsError, match=rf"^environment variable {next(iter(env))}: "):
            load_settings(env)


def test_library_defaults_and_an_unwritable_triton_cache(tmp_path, monkeypatch, caplog):
    """The worker's start sets oneDNN's and glibc's defaults (an endpoint's own value wins), and moves Triton's
    cache off a volume this user cannot write (the first compile would fail with PermissionError)."""
    import logging
    import os

    from handler.settings import set_library_defaults

    blocker = tmp_path / "file"
    blocker.write_text("")  # a path under a regular file can never be created, even by root
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocker / "triton-cache"))
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with caplog.at_level(logging.WARNING):
        set_library_defaults()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "home" / ".triton" / "cache")
    assert "cannot be written" in caplog.text
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7" and os.environ["MALLOC_ARENA_MAX"] == "2"
    writable = tmp_path / "volume" / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(writable))
    set_library_defaults()
    assert os.environ["TRITON_CACHE_DIR"] == str(writable)
