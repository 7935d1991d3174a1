"""Native jobs' logprobs and use_openai_format: what a native job asks for reaches its output on both paths
(the rest of the native and OpenAI job tests are tests/test_handler_jobs.py, whose worker this file shares)."""

from __future__ import annotations

import json

from handler.settings import load_settings
from handler.worker import Worker
from tests.test_handler_jobs import error_of, run_job
from tests.test_handler_jobs import worker as _worker

worker = _worker  # the module-scoped fixture (a Worker on the scripted engine), one instance for this module


def test_native_logprobs_plain_and_in_openai_format(worker):
    """sampling_params.logprobs / prompt_logprobs reach the output on both native paths: plain chunks carry each
    token's id and {token id: logprob}; use_openai_format gives OpenAI's chat logprobs and vLLM's prompt_logprobs."""
    msgs = [{"role": "user", "content": "hi"}]
    sp = {"temperature": 0, "max_tokens": 4, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1}
    for stream in (False, True):
        chunks = run_job(worker, {"prompt": "Hello there", "stream": stream, "sampling_params": sp})
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        lps = [d for c in chunks for d in c["choices"][0]["logprobs"]]
        assert len(ids) == len(lps) == 4 and all(t in d and 2 <= len(d) <= 3 and d[t] <= 0 for t, d in zip(ids, lps))
    assert (
        chunks[-1]["prompt_logprobs"][0] is None and len(chunks[-1]["prompt_logprobs"]) == chunks[-1]["usage"]["input"]
    )
    full = run_job(worker, {"messages": msgs, "use_openai_format": True, "sampling_params": sp})[0]
    content = full["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)
    prompt_lps = full["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == full["usage"]["prompt_tokens"] > 2
    streamed = run_job(
        worker,
        {
            "messages": msgs,
            "use_openai_format": True,
            "stream": True,
            "sampling_params": {**sp, "prompt_logprobs": None},
        },
    )
    events = [json.loads(e[6:]) for s in streamed for e in s.split("\n\n") if e.startswith("data: {")]
    assert sum(len((o["choices"][0]["logprobs"] or {}).get("content", [])) for o in events) == 4
    err = error_of(
        run_job(worker, {"messages": msgs, "use_openai_format": True, "stream": True, "sampling_params": sp})
    )
    assert err["param"] == "sampling_params.prompt_logprobs"


def test_openai_format_stream_options_and_batch_sizes(worker):
    """A native job's own batch sizes hold under use_openai_format; continuous_usage_stats puts the running usage
    on every chunk."""
    counts_only = Worker(load_settings({"STREAM_FLUSH_MS": "3600000"}), worker.engine)
    job = {
        "messages": [{"role": "user", "content": "Count to ten"}],
        "use_openai_format": True,
        "stream": True,
        "max_batch_size": 2,
        "sampling_params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True},
    }
    yields = run_job(counts_only, job)
    sizes = [s.count('"content"') for s in yields[1:-1]]
    assert len(yields) >= 4 and sizes and max(sizes) <= 2  # 1, 2, 2, ... not 1, 3, 9
    body = {**job.pop("sampling_params"), "messages": job["messages"], "stream": True}
    body["stream_options"] = {"continuous_usage_stats": True}
    sse = run_job(worker, {"openai_route": "/v1/chat/completions", "openai_input": body})
    objs = [json.loads(e[6:]) for s in sse for e in s.split("\n\n") if e.startswith("data: {")]
    counts = [o["usage"]["completion_tokens"] for o in objs]
    assert all("usage" in o for o in objs) and counts == sorted(counts) and counts[-1] == 8
    assert objs[0]["usage"]["prompt_tokens"] > 0
