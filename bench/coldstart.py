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
  fp8, first start    QUANTIZATION=fp8 with no snapshot: quantizes online while loading, writes the snapshot
  fp8 from snapshot   QUANTIZATION=fp8, second start: loads the fp8 snapshot the previous case wrote. (On CPU there
                      is no Triton kernel cache to warm: the torch kernels need no compilation.)
  HF transformers     a fresh `python` that imports torch + transformers, runs AutoTokenizer / AutoModelForCausalLM
                      .from_pretrained (bf16) on the same converted folder, then generate() on the same prompt with
                      a streamer; the time is from Popen to the streamer's first new token.
  floor               per round: `python -c "import torch"` in a fresh process (Popen to the line it prints next: its
                      exit is ~0.5 s of torch teardown no worker waits for) + `cat` of the bf16 weights to /dev/null
                      (warm) + one forward (the bf16 run's own "first token" phase): what any torch worker spends.

Runs are interleaved (one of each case per round); the table gives medians (3 rounds; the conversion case, ~20 s,
in the first 2 only), and each run's peak RSS (ru_maxrss of that child, from os.wait4). Weight-read bandwidth =
bytes of the files the weight phase read / that phase's seconds, against a plain sequential `cat` of the same
files to /dev/null timed right before that case's run: both are warm-page-cache numbers (the files were read
moments before), so this is the loader's overhead over a read, not the disk. The fp8 snapshot phase includes the
snapshot's sha256 check (timed separately here too).

Usage: python -m bench.coldstart           # ~3-4 min; writes docs/benchmarks.md (coldstart) + docs/coldstart.png
       python -m bench.coldstart --quick   # 1 round, prints only
       python -m bench.coldstart --importtime  # one bf16 start under `python -X importtime`: where imports go
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
JOB = {
    "input": {
        "prompt": PROMPT,
        "stream": True,
        "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }
}
CHAT_JOB = {
    "input": {
        "messages": [{"role": "user", "content": "Tell me about the history of the Roman Empire."}],
        "stream": True,
        "sampling_params": JOB["input"]["sampling_params"],
    }
}
CASES = ("first start ever", "bf16", "bf16, chat job", "fp8, first start", "fp8 from snapshot", "HF transformers")
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
    stdout lines; its peak RSS in MiB."""
    with tempfile.TemporaryFile("w+") as err:
        t0 = now()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        first, lines = None, []
        for line in proc.stdout:  # the stderr log goes to a file: no pipe can fill up
            if first is None and line.startswith(first_marker):
                first = now() - t0
            lines.append(line.rstrip("\n"))
            if now() - t0 > timeout:
                proc.kill()
                break
        # wait4, not wait: its rusage is this child's (ru_maxrss, KiB on Linux), where getrusage(RUSAGE_CHILDREN)
        # would be the largest of every child this bench has run so far
        _, status, usage = os.wait4(proc.pid, 0)
        wall = now() - t0
        proc.returncode = rc = os.waitstatus_to_exitcode(status)  # so Popen never waits for it again
        proc.stdout.close()
        if rc != 0 or first is None:
            err.seek(0)
            raise RuntimeError(
                f"{' '.join(cmd[:4])} ... exited {rc}:\n" + "\n".join(lines[-5:]) + "\n" + err.read()[-3000:]
            )
    return {"first": first, "wall": wall, "lines": lines, "rss": usage.ru_maxrss / 1024}


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
    ap.add_argument("--importtime", action="store_true", help="one bf16 start under -X importtime; prints only")
    ap.add_argument("--docs-dir", type=Path, default=None, help="where to write (default docs/, none with --quick)")
    args = ap.parse_args()
    rounds, conv_rounds = (1, 1) if args.quick else (3, 2)
    docs = args.docs_dir or (None if args.quick else REPO / "docs")
    drop = ("MODEL_NAME", "QUANTIZATION", "BASE_PATH", "TRITON_CACHE_DIR", "KV_CACHE_DTYPE", "HF_HOME", "HF_HUB_CACHE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_") and k not in drop}
    env |= dict(DTYPE="bfloat16", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    from bench._common import cat_seconds, cpu_pressure

    load, pressure, t_all = os.getloadavg()[0], cpu_pressure(), now()
    from engine.config import default_cache_root
    from engine.weights.default_model import ensure_default_model, sha256_file

    src = ensure_default_model(Path(default_cache_root()))  # converted once, in the user cache
    if args.importtime:  # BASE_PATH unset: the worker loads that converted model from the user cache
        return importtime(env)
    work = Path(tempfile.mkdtemp(prefix="coldstart-"))
    res: dict[str, list[dict]] = {c: [] for c in CASES}
    cat: dict[str, list[float]] = {"bf16": [], "fp8 snapshot": []}
    sha, imp, floor = [], [], []  # sha256 seconds; the fresh `import torch` runs; per round, FLOOR_PARTS' seconds
    try:
        bases = {}
        for name in ("bf16", "fp8"):  # a volume with the converted model on it (copy2 keeps mtimes)
            bases[name] = work / name
            shutil.copytree(src, bases[name] / "default-model" / src.name)
        model_dir = bases["bf16"] / "default-model" / src.name
        model_files = sorted(model_dir.glob("*.safetensors"))
        for r in range(rounds):
            if r < conv_rounds:
                fresh = work / f"fresh-{r}"
                fresh.mkdir()
                res["first start ever"].append(run_worker(fresh, env, fp8=False))
                shutil.rmtree(fresh)
            cat["bf16"].append(cat_seconds(model_files))
            res["bf16"].append(run_worker(bases["bf16"], env, fp8=False))
            imp.append(launch([sys.executable, "-c", "import torch; print('imported')"], env, "imported"))
            fwd = phase(res["bf16"][-1], FIRST_TOKEN)  # the worker's own forward: its prefill + first sample
            floor.append(dict(zip(FLOOR_PARTS, (imp[-1]["first"], cat["bf16"][-1], fwd))))
            res["bf16, chat job"].append(run_worker(bases["bf16"], env, fp8=False, job=CHAT_JOB))
            shutil.rmtree(bases["fp8"] / "fp8-snapshots", ignore_errors=True)
            cat["bf16"].append(cat_seconds(model_files))
            res["fp8, first start"].append(run_worker(bases["fp8"], env, fp8=True))
            snap_files = sorted((bases["fp8"] / "fp8-snapshots").glob("*/*.safetensors"))
            assert len(snap_files) == 1, snap_files
            t = now()
            sha256_file(snap_files[0])
            sha.append(now() - t)
            cat["fp8 snapshot"].append(cat_seconds(snap_files))
            res["fp8 from snapshot"].append(run_worker(bases["fp8"], env, fp8=True))
            res["HF transformers"].append(run_hf(model_dir, env))
            done = ", ".join(f"{c} {v[-1]['first']:.2f} s" for c, v in res.items() if v)
            print(f"round {r}: {done}, floor {sum(floor[-1].values()):.2f} s", flush=True)
        sizes = {"bf16": sum(f.stat().st_size for f in model_files), "fp8 snapshot": snap_files[0].stat().st_size}
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
    md = render(res, dict(cat=cat, sizes=sizes, sha=sha, imp=imp, floor=floor), intro)
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
        "Weight phase bandwidth vs `cat` of the same files (warm page cache, both):",
        "",
        "| case | phase | MiB | phase s | GB/s | cat s | cat GB/s | phase ÷ cat time |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in CASES[:-1]:  # ours
        name = weights_phase(res[c][0])["name"]
        secs = med(weights_phase(r)["seconds"] for r in res[c])
        key = "fp8 snapshot" if c == "fp8 from snapshot" else "bf16"
        nbytes, cat_s = m["sizes"][key], med(m["cat"][key])
        lines.append(
            f"| {c} | {name} | {nbytes / 2**20:.0f} | {secs:.3f} | {nbytes / secs / 1e9:.2f} | {cat_s:.3f} | "
            f"{nbytes / cat_s / 1e9:.2f} | {secs / cat_s:.1f}x |"
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
        "- The chat job's first token includes rendering its chat template (engine/chat_template.py, jinja2; "
        "transformers is not imported). fp8's first token is slower on CPU because fp8 matmuls are "
        "emulated there (weights converted to fp32 in every layer, every step); on a GPU they are "
        "`torch._scaled_mm`.",
        '- "weight read" is the loader (engine/weights/reader.py: reader threads, mmap views faulted in '
        "ahead of the consumer) plus the copy into the fused parameters; with fp8 also the per-channel quantization "
        'of each layer and writing the snapshot. "fp8 snapshot load" includes checking the snapshot\'s '
        f"sha256 against its manifest, which alone takes {med(m['sha']):.3f} s here (timed in the bench process "
        f"on the same file).",
        "- `cat` includes its process start (a few ms). Both numbers are from the page cache: on a network "
        "volume both would be slower and the reads, not the copies, would dominate.",
        "- The machine is a shared 2-core VM. The weight phase is the most sensitive to other processes: "
        "each of the ~270 copies into the parameters is an OpenMP region over torch's 2 threads, and when "
        "another process holds a core every region waits for a descheduled worker. Compare runs only at a "
        "similar CPU pressure (printed above).",
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


# ---- --importtime ---------------------------------------------------------------------------------------------
def importtime(env: dict, top: int = 15) -> None:
    """One bf16 worker start under `python -X importtime`; prints the level-0 imports by cumulative time, the
    self time per top-level package (first dotted component), and torch's cumulative against everything else."""
    cmd = [sys.executable, "-X", "importtime", "-m", "handler", "--test_input", json.dumps(JOB)]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = []  # (level, name, self us, cumulative us); CPython indents the name 2 spaces per nesting level
    for line in p.stderr.splitlines():
        if line.startswith("import time:") and "[us]" not in line:
            self_us, cum_us, name = line.removeprefix("import time:").split("|")
            rows.append(((len(name) - len(name.lstrip()) - 1) // 2, name.strip(), int(self_us), int(cum_us)))
    total = sum(r[2] for r in rows)
    pkgs: dict[str, int] = {}
    for _, name, self_us, _ in rows:
        pkgs[name.split(".")[0]] = pkgs.get(name.split(".")[0], 0) + self_us
    torch_us = next((r[3] for r in rows if r[1] == "torch"), 0)
    print(f"`python {' '.join(cmd[1:6])} '<the JOB json>'`: {len(rows)} modules, {total / 1e6:.2f} s in all")
    print("\n| level-0 import | cumulative ms | share |\n|---|---:|---:|")
    for _, name, _, cum in sorted((r for r in rows if r[0] == 0), key=lambda r: -r[3])[:top]:
        print(f"| {name} | {cum / 1e3:.0f} | {cum / total:.0%} |")
    print("\n| package | self ms (its modules, summed) | share |\n|---|---:|---:|")
    for name, us in sorted(pkgs.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {name} | {us / 1e3:.0f} | {us / total:.0%} |")
    print(f"\ntorch cumulative: {torch_us / 1e3:.0f} ms; everything else: {(total - torch_us) / 1e3:.0f} ms")


if __name__ == "__main__":
    main()
