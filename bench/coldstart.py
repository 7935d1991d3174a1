"""Cold start on CPU: process start to the first streamed token, our worker vs HF transformers.

Every case is a fresh process. Ours is the real worker, `python -m handler --test_input '{...stream: true...}'`
(it runs one native job through the handler and prints each chunk as `--- chunk i: ...`); the time is from Popen
to its first `--- chunk` line on stdout. The worker's own timeline (metrics.cold_start of the job's final chunk,
counted from handler/__main__.py's T0, its first line) splits it into phases; "before T0" is the rest (the
interpreter starting, `python -m` finding the package, the first chunk's print). The embedded default model
(SmolLM2-135M-Instruct, MODEL_NAME unset), DTYPE=bfloat16, greedy, 8 tokens, offline. Cases, each its own BASE_PATH:

  first start ever    empty BASE_PATH: includes converting the default model (GGUF -> bf16 safetensors)
  bf16                second start: the converted model is on the volume
  bf16, chat job      the same, with a `messages` job: the chat template is rendered on the path to the first
                      token (engine/chat_template.py's jinja2 renderer; transformers is not imported)
  bf16, HF's file ..  the same weights as safetensors writes them (HF's layout: copied, not kept in place)
  bf16, cold page ..  the bf16 case after dropping the file from the page cache (cat is timed cold the same way)
  fp8, first start    QUANTIZATION=fp8 with no snapshot: quantizes online while loading, writes the snapshot
  fp8 from snapshot   QUANTIZATION=fp8, second start: loads the fp8 snapshot the previous case wrote. (On CPU there
                      is no Triton kernel cache to warm: the torch kernels need no compilation.)
  HF transformers     a fresh `python` that imports torch + transformers, runs AutoTokenizer / AutoModelForCausalLM
                      .from_pretrained (bf16) on the same converted folder, then generate() on the same prompt with
                      a streamer; the time is from Popen to the streamer's first new token.
  floor               per round: `python -c "import torch"` in a fresh process (Popen to the line it prints next: its
                      exit is ~0.5 s of torch teardown no worker waits for) + `cat` of the bf16 weights to /dev/null
                      (warm) + one forward (the bf16 run's own "first token" phase): what any torch worker spends.

Our packages' bytecode is compiled first (bench/_common.py `byte_compile`), as the image's `pip install` does.
Runs are interleaved (one of each case per round, the conversion last, then a sync); the table gives medians (3
rounds; the conversion case, ~20 s, in the first 2 only) and each run's peak RSS (its VmHWM, read as it prints).
Weight-read bandwidth: the bytes the weight phase read / its seconds, against `cat` of the same files to /dev/null
right before that run (warm, both: the loader's overhead over a read; cold, both, in the cold case).

Usage: python -m bench.coldstart           # ~3-4 min; writes docs/benchmarks.md (coldstart) + docs/coldstart.png
       python -m bench.coldstart --quick   # 1 round, prints only
       python -m bench.importtime          # where a bf16 start's imports go (`python -X importtime`)
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # the HF child's own timeline counts from here, like handler/__main__.py's T0

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of"
MAX_TOKENS = 8
HF_LAYOUT, COLD = "bf16, HF's file layout", "bf16, cold page cache"
SAMPLING = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
JOB = {"input": {"prompt": PROMPT, "stream": True, "sampling_params": SAMPLING}}
CHAT = [{"role": "user", "content": "Tell me about the history of the Roman Empire."}]
CHAT_JOB = {"input": {"messages": CHAT, "stream": True, "sampling_params": SAMPLING}}
OURS = ("first start ever", "bf16", "bf16, chat job", HF_LAYOUT, COLD, "fp8, first start", "fp8 from snapshot")
CASES = (*OURS, "HF transformers")
WEIGHT_PHASES = ("weight read", "fp8 snapshot load", "weight read + fp8 quantization")
FIRST_TOKEN = "first token"  # handler/jobs.py's last phase: the prefill + sampling of one forward
FLOOR_PARTS = ("import torch", "cat of the weights", FIRST_TOKEN)
now, med = time.perf_counter, statistics.median


# ---- the HF child ---------------------------------------------------------------------------------------------
def hf_child(model_dir: str) -> None:
    """Fresh process: import, from_pretrained, generate with a streamer; prints FIRST at the first new token,
    then one JSON line with its phases (seconds from T0)."""
    marks = {}
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    marks["imports (torch, transformers)"] = now() - T0
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    marks["from_pretrained (tokenizer, model)"] = now() - T0
    first = {}

    class First(BaseStreamer):
        def __init__(self):
            self.calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls == 2:  # the first call is the prompt
                first["t"] = now() - T0
                first["text"] = tok.decode(value.reshape(-1)[:1])
                print("FIRST", flush=True)

        def end(self):
            pass

    ids = tok(PROMPT, return_tensors="pt")
    with torch.inference_mode():
        model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False, streamer=First())
    marks["generate to first token"] = first["t"]
    ats = [0.0, *marks.values()]
    phases = [{"name": n, "seconds": at - ats[i]} for i, (n, at) in enumerate(marks.items())]
    out = dict(total_s=first["t"], phases=phases, first_token=first["text"], transformers=transformers.__version__)
    print(json.dumps(out), flush=True)


# ---- launching ------------------------------------------------------------------------------------------------
def launch(cmd: list[str], env: dict, first_marker: str, timeout: float = 300) -> dict:
    """Run `cmd`; seconds from Popen to the first stdout line starting with `first_marker` and to its exit; all
    stdout lines; its peak RSS in MiB: VmHWM (the high-water mark of its memory since exec), read after each line it
    prints, its last line included (a start's peak is long past by then; the exit only frees). Not ru_maxrss: for
    a forked child it counts this bench's own memory, copied at the fork, before the exec."""
    with tempfile.TemporaryFile("w+") as err:
        t0 = now()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        first, lines, hwm = None, [], 0.0
        for line in proc.stdout:  # the stderr log goes to a file: no pipe can fill up
            if first is None and line.startswith(first_marker):
                first = now() - t0
            lines.append(line.rstrip("\n"))
            hwm = max(hwm, vm_hwm_mib(proc.pid))
            if now() - t0 > timeout:
                proc.kill()
                break
        rc = proc.wait()
        wall = now() - t0
        if rc != 0 or first is None:
            err.seek(0)
            raise RuntimeError(
                f"{' '.join(cmd[:4])} ... exited {rc}:\n" + "\n".join(lines[-5:]) + "\n" + err.read()[-3000:]
            )
    return {"first": first, "wall": wall, "lines": lines, "rss": hwm}


def vm_hwm_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # it has exited
        return 0.0
    return next((int(ln.split()[1]) / 1024 for ln in status.splitlines() if ln.startswith("VmHWM:")), 0.0)


def run_worker(base: Path, env: dict, fp8: bool, job: dict = JOB) -> dict:
    env = env | {"BASE_PATH": str(base), "TRITON_CACHE_DIR": str(base / "triton")}
    if fp8:
        env["QUANTIZATION"] = "fp8"
    r = launch([sys.executable, "-m", "handler", "--test_input", json.dumps(job)], env, "--- chunk")
    final = json.loads(r["lines"][-1])
    assert final["status"] == "COMPLETED", final
    tl, tok = final["output"][-1]["metrics"]["cold_start"], "".join(final["output"][0]["choices"][0]["tokens"])
    return dict(first=r["first"], total=tl["total_s"], phases=tl["phases"], first_token=tok, rss=r["rss"])


def run_hf(model_dir: Path, env: dict) -> dict:
    r = launch([sys.executable, "-m", "bench.coldstart", "--hf-child", str(model_dir)], env, "FIRST")
    out = json.loads(r["lines"][-1])
    return dict(first=r["first"], total=out.pop("total_s"), rss=r["rss"], **out)  # phases, first_token


def hf_layout(f: Path) -> None:
    """Rewrite `f` as safetensors' own writer lays it out (transformers' save_pretrained): tensors by name, data 8
    bytes past a 64-byte boundary, so the engine copies what it cannot keep in place: any HF checkpoint."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(f), framework="pt") as h:
        meta, tensors = h.metadata(), {n: h.get_tensor(n).clone() for n in h.keys()}
    save_file(tensors, str(f), metadata=meta)


def weights_phase(res: dict) -> dict | None:
    return next((p for p in res["phases"] if p["name"] in WEIGHT_PHASES), None)


def phase(run: dict, name: str) -> float:
    return next((p["seconds"] for p in run["phases"] if p["name"] == name), 0.0)


# ---- the run --------------------------------------------------------------------------------------------------
def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--hf-child":
        return hf_child(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round; prints only")
    ap.add_argument("--docs-dir", type=Path, default=None, help="where to write (default docs/, none with --quick)")
    args = ap.parse_args()
    rounds, conv_rounds = (1, 1) if args.quick else (3, 2)
    docs = args.docs_dir or (None if args.quick else REPO / "docs")
    drop = ("MODEL_NAME", "QUANTIZATION", "BASE_PATH", "TRITON_CACHE_DIR", "KV_CACHE_DTYPE", "HF_HOME", "HF_HUB_CACHE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_") and k not in drop}
    env |= dict(DTYPE="bfloat16", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    from bench._common import byte_compile, cat_seconds, cpu_pressure, drop_cache, map_seconds, snapshot_check_seconds

    byte_compile()

    load, pressure, t_all = os.getloadavg()[0], cpu_pressure(), now()
    from engine.config import default_cache_root
    from engine.weights.default_model import ensure_default_model

    src = ensure_default_model(Path(default_cache_root()))  # converted once, in the user cache
    work = Path(tempfile.mkdtemp(prefix="coldstart-"))
    res: dict[str, list[dict]] = {c: [] for c in CASES}
    cat: dict[str, list[float]] = {"bf16": [], "bf16 cold": [], "fp8 snapshot": [], "bf16 map": []}
    sha, pieces, imp, floor = [], [], [], []  # sha256 s (whole file, per piece); `import torch` runs; FLOOR_PARTS' s
    try:
        bases = {}
        for name in ("bf16", "fp8", "hf"):  # a volume with the converted model on it (copy2 keeps mtimes)
            bases[name] = work / name
            shutil.copytree(src, bases[name] / "default-model" / src.name)
        model_dir = bases["bf16"] / "default-model" / src.name
        model_files = sorted(model_dir.glob("*.safetensors"))
        hf_layout(bases["hf"] / "default-model" / src.name / "model.safetensors")
        for r in range(rounds):
            cat["bf16"].append(cat_seconds(model_files))
            cat["bf16 map"].append(map_seconds(model_files))
            res["bf16"].append(run_worker(bases["bf16"], env, fp8=False))
            imp.append(launch([sys.executable, "-c", "import torch; print('imported')"], env, "imported"))
            fwd = phase(res["bf16"][-1], FIRST_TOKEN)  # the worker's own forward: its prefill + first sample
            floor.append(dict(zip(FLOOR_PARTS, (imp[-1]["first"], cat["bf16"][-1], fwd))))
            res["bf16, chat job"].append(run_worker(bases["bf16"], env, fp8=False, job=CHAT_JOB))
            res[HF_LAYOUT].append(run_worker(bases["hf"], env, fp8=False))
            drop_cache(model_files)  # cold: cat, then the worker, each after dropping the file from the page cache
            cat["bf16 cold"].append(cat_seconds(model_files))
            drop_cache(model_files)
            res[COLD].append(run_worker(bases["bf16"], env, fp8=False))
            shutil.rmtree(bases["fp8"] / "fp8-snapshots", ignore_errors=True)
            cat["bf16"].append(cat_seconds(model_files))
            res["fp8, first start"].append(run_worker(bases["fp8"], env, fp8=True))
            snap_files = sorted((bases["fp8"] / "fp8-snapshots").glob("*/*.safetensors"))
            assert len(snap_files) == 1, snap_files
            whole, by_piece = snapshot_check_seconds(snap_files[0])
            sha.append(whole)
            pieces.append(by_piece)
            cat["fp8 snapshot"].append(cat_seconds(snap_files))
            res["fp8 from snapshot"].append(run_worker(bases["fp8"], env, fp8=True))
            res["HF transformers"].append(run_hf(model_dir, env))
            if r < conv_rounds:  # last in the round: its 0.8 GB of writes would be flushed during the next case
                fresh = work / f"fresh-{r}"
                fresh.mkdir()
                res["first start ever"].append(run_worker(fresh, env, fp8=False))
                shutil.rmtree(fresh)
                os.sync()
            done = ", ".join(f"{c} {v[-1]['first']:.2f} s" for c, v in res.items() if v)
            print(f"round {r}: {done}, floor {sum(floor[-1].values()):.2f} s", flush=True)
        sizes = {"bf16": sum(f.stat().st_size for f in model_files), "fp8 snapshot": snap_files[0].stat().st_size}
        sizes["bf16 cold"] = sizes["bf16"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for c, want in (("fp8, first start", "weight read + fp8 quantization"), ("fp8 from snapshot", "fp8 snapshot load")):
        got = {weights_phase(x)["name"] for x in res[c]}
        assert got == {want}, f"{c}: weight phase {got}, wanted {want}"

    from bench._common import machine_line, write_section

    cmd = ("python -m bench.coldstart " + " ".join(sys.argv[1:])).strip()
    load = f"load average {load:.2f}, CPU pressure {pressure} at start; {cpu_pressure()} at the end"
    intro = (
        f"`{cmd}` on {time.strftime('%Y-%m-%d')}: {machine_line('cpu')}; {load}. SmolLM2-135M-Instruct (the "
        f"embedded default), bfloat16 activations, {MAX_TOKENS} greedy tokens, one fresh process per run. Method: "
        f"the docstring of `bench/coldstart.py`. Medians of {rounds} interleaved rounds (the conversion case: "
        f"{conv_rounds})."
    )
    md = render(res, dict(cat=cat, sizes=sizes, sha=sha, pieces=pieces, imp=imp, floor=floor), intro)
    print("\n" + md + f"\n\n(total {now() - t_all:.0f} s)")
    if docs is not None:
        write_section(docs / "benchmarks.md", "coldstart", md)
        plot(res, floor, docs / "coldstart.png")
        print(f"\nwrote {docs / 'benchmarks.md'} and {docs / 'coldstart.png'}")


def phase_medians(runs: list[dict]) -> list[tuple[str, float]]:
    """Per-phase medians over runs (phase order of the first run), with 'before T0' first."""
    names = [p["name"] for p in runs[0]["phases"]]
    before = [("before T0", med(r["first"] - r["total"] for r in runs))]
    return before + [(n, med(phase(r, n) for r in runs)) for n in names]


def render(res: dict, m: dict, intro: str) -> str:
    from engine.weights import fp8_snapshot

    hf, hf_rss = med(r["first"] for r in res["HF transformers"]), med(r["rss"] for r in res["HF transformers"])
    floors = [sum(f.values()) for f in m["floor"]]
    lines = [
        f"## Cold start to first token (CPU)\n\n{intro}\n",
        "| case | process start → first token s | each run s | worker timeline s | ÷ HF | peak RSS MiB | RSS ÷ HF "
        "| first token |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c, runs in res.items():
        first, rss = med(r["first"] for r in runs), med(r["rss"] for r in runs)
        total = "–" if c == "HF transformers" else f"{med(r['total'] for r in runs):.2f}"
        each = ", ".join(f"{r['first']:.2f}" for r in runs)
        lines.append(
            f"| {c} | {first:.2f} | {each} | {total} | {first / hf:.2f}x | {rss:.0f} | {rss / hf_rss:.2f}x | "
            f"`{runs[0]['first_token']!r}` |"
        )
    each, fl = ", ".join(f"{f:.2f}" for f in floors), med(floors)
    lines.append(f"| floor: {' + '.join(FLOOR_PARTS)} | {fl:.2f} | {each} | – | {fl / hf:.2f}x | – | – | – |")
    lines += [
        "",
        "Phases, median seconds (\"before T0\": process start to the process's first line, bench/coldstart.py's "
        "for HF, plus the first token's print):",
        "",
    ]
    for c in CASES:
        lines.append(f"- **{c}**: " + ", ".join(f"{n} {s:.2f}" for n, s in phase_medians(res[c]) if s >= 0.005))
    lines.append("- **floor**: " + ", ".join(f"{n} {med(f[n] for f in m['floor']):.2f}" for n in FLOOR_PARTS))
    lines += [
        "",
        "Weight phase bandwidth vs `cat` of the same files (warm page cache, both; the cold case: both cold):",
        "",
        "| case | phase | MiB | phase s | GB/s | cat s | cat GB/s | phase ÷ cat time | phase ÷ map time |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in OURS:
        name = weights_phase(res[c][0])["name"]
        secs = med(weights_phase(r)["seconds"] for r in res[c])
        key = {"fp8 from snapshot": "fp8 snapshot", COLD: "bf16 cold"}.get(c, "bf16")
        nbytes, cat_s = m["sizes"][key], med(m["cat"][key])
        lines.append(
            f"| {c} | {name} | {nbytes / 2**20:.0f} | {secs:.3f} | {nbytes / secs / 1e9:.2f} | {cat_s:.3f} | "
            f"{nbytes / cat_s / 1e9:.2f} | {secs / cat_s:.1f}x | "
            + (f"{secs / med(m['cat']['bf16 map']):.1f}x |" if key == "bf16" else "– |")
        )
    bf16 = res["bf16"]
    above = [r["first"] - f for r, f in zip(bf16, floors)]  # paired: the same round
    imp_s, imp_exit = med(x["first"] for x in m["imp"]), med(x["wall"] for x in m["imp"])
    imports = med(r["first"] - r["total"] + phase(r, "imports") for r in bf16) - imp_s
    lines += [
        "",
        "Notes:",
        f"- Targets (issue #27), bf16 case: process start → first token ≤ 0.33x HF (now "
        f"{med(r['first'] for r in bf16) / hf:.2f}x) and within 0.3 s of the floor (now ours − floor = "
        f"{med(above):+.2f} s, per round {', '.join(f'{a:+.2f}' for a in above)}); peak RSS ≤ 1.3x HF's (now "
        f"{med(r['rss'] for r in bf16) / hf_rss:.2f}x). HF's figure is {hf:.2f} s (import torch + transformers, "
        "from_pretrained, generate to the first new token), for the plain prompt (its chat template is not timed).",
        f"- imports above import torch: {imports:.2f} s (target ≤ 0.5 s): the bf16 runs' before T0 + imports, "
        f"less the fresh `import torch` ({imp_s:.2f} s from Popen to its next line; {imp_exit:.2f} s to its exit, "
        f"torch's teardown; {med(x['rss'] for x in m['imp']):.0f} MiB peak RSS). `--importtime` shows where it goes.",
        "- The chat job's first token includes rendering its chat template (jinja2; no transformers). fp8 is "
        "slower on CPU: its matmuls are emulated (weights to fp32 in every layer, every step).",
        '- "weight read" is the loader (engine/weights/reader.py: views of each file\'s map, faulted in by one thread '
        'while the consumer takes them) and what the model does with them ("model build", the empty model, is a '
        "phase of its own): the converted default model is laid out "
        "as the engine's parameters (engine/weights/layout.py), so they are those views, no copy; "
        f'"{HF_LAYOUT}" is the same weights as safetensors writes them (any HF checkpoint): copies. With fp8 '
        'also the per-channel quantization of each layer and writing the snapshot. "fp8 snapshot load" includes '
        f"checking the snapshot against its manifest: a SHA-256 per {fp8_snapshot.PIECE >> 20} MiB piece on "
        f"{fp8_snapshot.hash_threads()} threads, {med(m['pieces']):.3f} s here, against {med(m['sha']):.3f} s for one "
        f"digest of the whole file ({med(m['sha']) / max(med(m['pieces']), 1e-9):.2f}x).",
        "- `cat` includes its process start (a few ms). The cold case drops the file from the page cache "
        "(POSIX_FADV_DONTNEED) before `cat` and again before the worker; this VM's disk may still be cached below it. "
        f'"map" ({med(m["cat"]["bf16 map"]):.3f} s, median) maps the warm bf16 files in the bench\'s own process '
        "and faults every page in (bench/_common.py `map_seconds`): the least that any loader which keeps the bytes "
        "addressable pays; `cat` copies them through one small buffer and keeps none.",
        "- A shared 2-core VM: copies into parameters are OpenMP regions over torch's 2 threads, which wait for a "
        "descheduled thread when another process holds a core. Compare runs at a similar CPU pressure (above).",
        "",
        "![Cold start timeline per case](coldstart.png)",
    ]
    return "\n".join(lines)


def plot(res: dict, floor: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(c, [(n, s) for n, s in phase_medians(res[c]) if s >= 0.005]) for c in CASES]
    rows.append(("floor", [(n, med(f[n] for f in floor)) for n in FLOOR_PARTS]))  # "first token" shares its colour
    names = list(dict.fromkeys(n for _, ph in rows for n, _ in ph))
    color = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for y, (_, ph) in enumerate(rows):
        left = 0.0
        for n, s in ph:
            label = None if n in ax.get_legend_handles_labels()[1] else n
            ax.barh(y, s, left=left, color=color[n], edgecolor="white", linewidth=0.5, label=label)
            left += s
        ax.text(left + 0.1, y, f"{left:.1f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [c for c, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from process start to the first streamed token (median per phase)")
    ax.set_title("Cold start on CPU, SmolLM2-135M: our worker vs HF transformers")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_xlim(0, ax.get_xlim()[1] * 1.05)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
