"""The import rules of docs/architecture.md, checked on the source."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PURE = {"engine/scheduler.py", "engine/block_manager.py", "engine/detokenizer.py", "engine/types.py"}


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    return mods


def _files(pkg: str):
    return sorted((ROOT / pkg).rglob("*.py"))


def test_import_rules():
    problems = []
    for pkg in ("engine", "handler", "kernels", "warmup"):
        for f in _files(pkg):
            rel = str(f.relative_to(ROOT))
            mods = _imports(f)
            top = {m.split(".")[0] for m in mods}
            if pkg == "engine" and "handler" in top:
                problems.append(f"{rel} imports handler")
            if pkg == "kernels" and top & {"engine", "handler"}:
                problems.append(f"{rel} imports engine/handler")
            if pkg == "handler" and any(m.startswith("engine.") for m in mods):
                problems.append(f"{rel} imports engine internals (use `from engine import ...`)")
            if rel in PURE and "torch" in top:
                problems.append(f"{rel} imports torch")
            src = f.read_text()
            if ("os.environ" in src or "os.getenv" in src) and rel != "handler/settings.py":
                problems.append(f"{rel} reads the environment")
    assert not problems, problems
