"""warmup.plan reproduces the seed's worked example from a config alone."""

from __future__ import annotations

import json

from engine.models.llama import ModelSpec
from tests.test_memory import LLAMA3_70B
from warmup.plan import main, make_plan, parse_bytes


def test_seed_worked_example(tmp_path, capsys):
    spec = ModelSpec.from_hf(LLAMA3_70B)
    p = make_plan(spec, parse_bytes("80GiB"), max_model_len=4096, quantization="fp8", kv_cache_dtype="fp8")
    assert p["kv_bytes_per_token"] == 160 * 1024  # 2 x 80 layers x 8 kv heads x 128 x 1 byte
    total_kib = 100 * 4096 * p["kv_bytes_per_token"] / 1024
    assert total_kib == 65_536_000  # "about 65.5 GB": 65.5 million KiB
    assert 70e9 < p["weight_bytes"] < 75e9  # 70.6 B params, linear layers at 1 byte, embeddings in bf16
    assert p["fits"]  # ~72.7 GB of fp8 weights fit an 80 GiB card, with room for a 4k sequence
    bf16 = make_plan(spec, parse_bytes("80GiB"), max_model_len=4096)
    assert bf16["kv_bytes_per_token"] == 2 * p["kv_bytes_per_token"] and not bf16["fits"]

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))
    argv = [
        "--model",
        str(tmp_path),
        "--gpu-mem",
        "80GiB",
        "--max-model-len",
        "4096",
        "--quantization",
        "fp8",
        "--kv-cache-dtype",
        "fp8",
    ]
    assert main([*argv, "--requests", "100"]) == 0
    out = capsys.readouterr().out
    assert "163,840 B (160 KiB)" in out and "65,536,000 KiB" in out and "fits on one GPU" in out
    assert main([*argv, "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert (
        {
            "weight_bytes",
            "kv_bytes_per_token",
            "activation_reserve_bytes",
            "kv_tokens",
            "max_model_len",
            "max_concurrent_seqs",
            "fits",
            "error",
        }
        <= set(j)
        and j["fits"]
        and j["error"] is None
    )
    # on an 80 GB card (decimal) it does not fit, and says so: exit 1, the numbers in the error
    assert main(["--model", str(tmp_path), "--gpu-mem", "80GB", "--quantization", "fp8", "--json"]) == 1
    j = json.loads(capsys.readouterr().out)
    assert not j["fits"] and "does not fit" in j["error"] and "67.69 GiB" in j["error"]


def test_bad_inputs(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing")]) == 1
    assert "error" in capsys.readouterr().err
    assert parse_bytes("141GB") == 141 * 10**9 and parse_bytes("80 GiB") == 80 * 2**30


def test_cuda_graphs_pool_is_planned(tmp_path, capsys):
    """--no-enforce-eager sets the graph pool aside: the reserve grows by it and the KV pool shrinks by as much."""
    from tests.test_memory import LLAMA31_8B

    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B))
    argv = ["--model", str(tmp_path), "--gpu-mem", "80GiB", "--max-model-len", "8192", "--json"]
    assert main(argv) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main([*argv, "--no-enforce-eager"]) == 0
    graphs = json.loads(capsys.readouterr().out)
    assert eager["graph_pool_bytes"] == 0 < graphs["graph_pool_bytes"]
    grow = graphs["activation_reserve_bytes"] - eager["activation_reserve_bytes"]
    assert grow == graphs["graph_pool_bytes"]
    lost = (eager["kv_tokens"] - graphs["kv_tokens"]) * eager["kv_bytes_per_token"]
    assert 0 <= grow - lost < 16 * eager["kv_bytes_per_token"]  # down to one 16-token block
