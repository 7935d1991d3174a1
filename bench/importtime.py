"""Where a worker start's imports go: one bf16 start of the embedded default model (`python -m handler
--test_input`, BASE_PATH unset: the model converted in the user cache) under `python -X importtime`. Prints, for
the imports before the engine was ready, the level-0 imports by cumulative time, the self time per top-level
package, and torch's cumulative against everything else (issue #27: imports at most 0.5 s above `import torch`);
then what was imported after ready (the idle pieces: the OpenAI routes, a chat template's jinja2).

Usage: python -m bench.importtime [--write-docs]   # --write-docs: the importtime section of docs/benchmarks.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench._common import producer
from bench.coldstart import JOB, REPO


def importtime(env: dict, top: int = 12) -> str:
    """One bf16 worker start under `python -X importtime`: the imports before the engine was ready (what the cold
    start pays: the level-0 imports by cumulative time, the self time per top-level package, torch's cumulative
    against everything else), then the ones after it (the idle pieces' and the job's), as markdown."""
    cmd = [sys.executable, "-X", "importtime", "-m", "handler", "--test_input", json.dumps(JOB)]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows, after = [], []  # (level, name, self us, cumulative us); CPython indents the name 2 spaces per level
    for line in p.stderr.splitlines():
        if "engine ready in" in line:  # the worker's log line, in order with -X importtime's on stderr
            rows, after = after, rows
        if line.startswith("import time:") and "[us]" not in line:
            self_us, cum_us, name = line.removeprefix("import time:").split("|")
            after.append(((len(name) - len(name.lstrip()) - 1) // 2, name.strip(), int(self_us), int(cum_us)))
    rows, after = (after, []) if not rows else (rows, after)
    total = sum(r[2] for r in rows)
    pkgs: dict[str, int] = {}
    for _, name, self_us, _ in rows:  # noqa: B007 - the package's own modules summed
        pkgs[name.split(".")[0]] = pkgs.get(name.split(".")[0], 0) + self_us
    torch_us = next((r[3] for r in rows if r[1] == "torch"), 0)
    later = sorted((r for r in after if r[0] == 0), key=lambda r: -r[3])[:6]
    out = [
        f"{producer('python -m bench.importtime', 'cpu')} `python -X importtime -m handler --test_input '<a job>'`, "
        f"the embedded default model. Before the engine was ready: {len(rows)} modules, {total / 1e6:.2f} s of "
        f"imports in all; torch's cumulative {torch_us / 1e3:.0f} ms, everything else {(total - torch_us) / 1e3:.0f} "
        f"ms. After it (idle pieces, the job): {len(after)} modules, {sum(r[2] for r in after) / 1e3:.0f} ms"
        + (": " + ", ".join(f"{r[1]} {r[3] / 1e3:.0f} ms" for r in later) if later else "")
        + ". (-X importtime's own bookkeeping inflates every figure; the worker's start runs with the collector "
        "off, handler/__main__.py.)",
        "",
        "| level-0 import before ready | cumulative ms | | package | self ms, its modules summed |",
        "|---|---:|---|---|---:|",
    ]
    level0 = sorted((r for r in rows if r[0] == 0), key=lambda r: -r[3])[:top]
    packages = sorted(pkgs.items(), key=lambda kv: -kv[1])[:top]
    for (_, name, _, cum), (pkg, us) in zip(level0, packages):
        out.append(f"| {name} | {cum / 1e3:.0f} | | {pkg} | {us / 1e3:.0f} |")
    return "\n".join(out)


def main() -> None:
    from bench._common import byte_compile, write_section
    from engine.config import default_cache_root
    from engine.weights.default_model import ensure_default_model

    ensure_default_model(Path(default_cache_root()))  # converted once: not part of what is measured
    byte_compile()  # as a user's worker has it: not compiled in every start
    drop = ("MODEL_NAME", "QUANTIZATION", "BASE_PATH", "KV_CACHE_DTYPE", "HF_HOME", "HF_HUB_CACHE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_") and k not in drop}
    md = "## Imports of a worker start\n\n" + importtime(env | dict(DTYPE="bfloat16", HF_HUB_OFFLINE="1"))
    print(md)
    if "--write-docs" in sys.argv:
        write_section(REPO / "docs" / "benchmarks.md", "importtime", md)


if __name__ == "__main__":
    main()
