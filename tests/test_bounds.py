"""Every cache and table the worker keeps has a bound (docs/decisions.md, "Faults": the list), and each is exceeded
here: the oldest entries go, the newest stay. (The KV pool's prefix cache, the LoRA device slots and the LoRA disk
cache are exceeded in tests/test_prefix_cache.py, tests/test_lora_engine.py and tests/test_lora_store.py.)"""

from __future__ import annotations

from concurrent.futures import Future

from engine import EngineConfig
from engine.lora import manager as lora_manager
from engine.structured import CACHE_ENTRIES, StructuredOutputs
from engine.types import StructuredOutputsParams


def test_compiled_grammars_are_an_lru_of_cache_entries(monkeypatch):
    so = StructuredOutputs(tok=None, vocab_size=10, stop_token_ids=[0])
    compiled = []
    monkeypatch.setattr(so, "_compile", compiled.append)  # the bound, not xgrammar, is under test
    for i in range(CACHE_ENTRIES + 50):
        so.compile(StructuredOutputsParams(regex=f"a{i}")).result()
    assert len(so._cache) == CACHE_ENTRIES and len(compiled) == CACHE_ENTRIES + 50
    so.compile(StructuredOutputsParams(regex=f"a{CACHE_ENTRIES + 49}")).result()  # cached
    assert len(compiled) == CACHE_ENTRIES + 50
    so.compile(StructuredOutputsParams(regex="a0")).result()  # long gone: compiled again
    assert len(compiled) == CACHE_ENTRIES + 51
    so.shutdown()


def test_the_responses_store_keeps_the_newest_stored(monkeypatch):
    from handler import openai_responses as r

    monkeypatch.setattr(r, "_store", type(r._store)())
    req, _ = r.parse_request({"input": "hi"}, "openai_input")
    for i in range(r.STORED + 10):
        shaper = r._Shaper(req, [{"role": "user", "content": "hi"}], "m")
        shaper.id = f"resp_{i}"
        shaper.finish([], {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}},
                      "stop")  # fmt: skip
    assert len(r._store) == r.STORED and "resp_9" not in r._store and f"resp_{r.STORED + 9}" in r._store


def test_chat_templates_compiled_are_an_lru():
    from engine.chat_template import compile_template

    for i in range(40):
        compile_template(f"{{{{ messages[0].content }}}} {i}")
    info = compile_template.cache_info()
    assert info.currsize == info.maxsize == 16


def test_finished_job_records_are_bounded_besides_their_retention(monkeypatch):
    from handler import job_front
    from handler.local_jobs import Job

    monkeypatch.setattr(job_front, "KEPT_RESULTS", 5)
    front = job_front.JobFront(runsync_wait=1, stream_wait=1, retention=3600)
    front.dispatch = lambda job: front.finish(job, "COMPLETED", output=["x" * 1000])
    jobs = [front.submit({"prompt": "p"}) for _ in range(20)]
    assert isinstance(jobs[0], Job) and len(front.jobs) <= 6
    assert jobs[-1].id in front.jobs and jobs[0].id not in front.jobs


def test_lora_names_and_waiting_host_copies_are_bounded(lora_bases, tmp_path, monkeypatch):
    from tests.lora_fixtures import model_spec

    monkeypatch.setattr(lora_manager, "KNOWN_ADAPTERS", 20)
    cfg = EngineConfig(enable_lora=True, lora_s3_uri="s3://bucket/a/", cache_root=str(tmp_path))
    mgr = lora_manager.LoRAManager(cfg, model_spec(lora_bases["llama"]), slots=None)
    loaded = Future()
    loaded.set_result(["host tensors"])
    monkeypatch.setattr(mgr._pool, "submit", lambda fn, ref: loaded)  # loaded at once, never given a slot
    for i in range(100):
        mgr.request(mgr.resolve(f"adapter{i}"))
    assert len([f for f in mgr._jobs.values() if f.done()]) <= lora_manager.HOST_ADAPTERS + 1
    assert len(mgr.refs) <= 20 + lora_manager.HOST_ADAPTERS + 1 and "adapter99" in mgr.names()
    assert "adapter0" not in mgr.names() and len(mgr._started) == len(mgr.refs)
    mgr.shutdown()


def test_a_request_forgotten_while_it_waited_fails_clearly(lora_bases, tmp_path):
    from tests.lora_fixtures import model_spec

    cfg = EngineConfig(enable_lora=True, lora_s3_uri="s3://bucket/a/", cache_root=str(tmp_path))
    mgr = lora_manager.LoRAManager(cfg, model_spec(lora_bases["llama"]), slots=None)
    err = mgr.status("never-seen", arrival=0.0)
    assert err is not None and "forgotten" in str(err)
    mgr.shutdown()


def test_cpu_gemm_shapes_are_bounded_and_the_padding_changes_no_row(monkeypatch):
    """oneDNN keeps memory per GEMM shape for good (engine/layers/dense.py): a 16-bit linear on CPU runs at a
    bounded set of row counts, whatever the step's token count, and the rows it returns are the unpadded ones."""
    import torch
    import torch.nn.functional as F

    from engine.layers import dense

    torch.manual_seed(0)
    w, b = torch.randn(48, 32, dtype=torch.bfloat16), torch.randn(48, dtype=torch.bfloat16)
    shapes = set()
    real = F.linear

    def record(x, w, bias=None):
        shapes.add(x.shape[0])
        return real(x, w, bias)

    monkeypatch.setattr(dense.F, "linear", record)
    monkeypatch.setattr(dense, "onednn_bf16", lambda: True)  # not widened to fp32 (a CPU with AVX-512)
    monkeypatch.setattr(dense, "_thin", lambda: None)  # oneDNN's path: the thin GEMM keeps nothing per shape
    for rows in range(1, 2049):
        x = torch.randn(rows, 32, dtype=torch.bfloat16)
        y = dense.dense(x, w, b)
        assert y.shape == (rows, 48)
        if rows in (1, 17, 255, 1000, 2048):
            assert torch.allclose(y.float(), real(x, w, b).float(), atol=0.05, rtol=0.02)
    assert len(shapes) <= 16 + 15 + 28 and max(shapes) == 2048
    x32 = torch.randn(17, 32)
    shapes.clear()
    dense.dense(x32, w.float())
    assert shapes == {17}  # fp32 keeps its exact shape (MKL; the parity tests)
    monkeypatch.setattr(dense, "onednn_bf16", lambda: False)  # AVX2 alone, without the AVX2 GEMM (no compiler):
    monkeypatch.setattr(dense, "AVX2", False)  # bf16 widened to MKL's fp32, exact too
    dense.dense(torch.randn(33, 32, dtype=torch.bfloat16), w, b)
    assert shapes == {17, 33}
