"""handler/settings.py: worker-vllm env names -> a frozen EngineConfig; bad values name the variable."""
from __future__ import annotations

import pytest

from handler.settings import SettingsError, load_settings


def test_defaults_locally_and_on_runpod():
    local = load_settings({})
    cfg = local.engine_config()
    assert cfg.model is None and cfg.dtype == "auto" and ".cache" in cfg.cache_root
    pod = load_settings({"RUNPOD_POD_ID": "abc", "MODEL_NAME": "org/m", "MAX_MODEL_LEN": "4096", "DTYPE": "half"})
    cfg = pod.engine_config()
    assert cfg.cache_root == "/runpod-volume" and cfg.model == "org/m" and cfg.max_model_len == 4096
    assert cfg.dtype == "float16"
    assert "/runpod-volume/huggingface-cache/hub" in cfg.hf_cache_dirs
    assert load_settings({"BASE_PATH": "/vol", "HF_HOME": "/hf"}).engine_config().hf_cache_dirs[:2] == (
        "/hf/hub", "/vol/huggingface-cache/hub")


@pytest.mark.parametrize("env,name", [
    ({"MAX_MODEL_LEN": "lots"}, "MAX_MODEL_LEN"), ({"MAX_NUM_SEQS": "0"}, "MAX_NUM_SEQS"),
    ({"GPU_MEMORY_UTILIZATION": "1.5"}, "GPU_MEMORY_UTILIZATION"), ({"DTYPE": "int4"}, "DTYPE"),
])
def test_invalid_values_name_the_variable(env, name):
    with pytest.raises(SettingsError, match=name):
        load_settings(env)
