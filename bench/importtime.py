"""Where a worker start's imports go: one bf16 start of the embedded default model (`python -m handler
--test_input`, BASE_PATH unset: the model converted in the user cache) under `python -X importtime`. Prints the
level-0 imports by cumulative time, the self time per top-level package, and torch's cumulative against everything
else (issue #27: imports at most 0.5 s above `import torch`). Prints only.

Usage: python -m bench.importtime
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.coldstart import JOB, REPO


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
    for _, name, self_us, _ in rows:  # noqa: B007 - the package's own modules summed
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


def main() -> None:
    from engine.config import default_cache_root
    from engine.weights.default_model import ensure_default_model

    ensure_default_model(Path(default_cache_root()))  # converted once: not part of what is measured
    drop = ("MODEL_NAME", "QUANTIZATION", "BASE_PATH", "KV_CACHE_DTYPE", "HF_HOME", "HF_HUB_CACHE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_") and k not in drop}
    importtime(env | dict(DTYPE="bfloat16", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))


if __name__ == "__main__":
    main()
