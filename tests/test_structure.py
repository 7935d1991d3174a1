"""The floors of docs/architecture.md, checked on the source: who may import whom, what stays free of torch, module
size, and the one module that reads the environment."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "engine", "handler", "warmup")
# the scheduler side: plain Python over plain dataclasses, so it can be read and tested without a device
NO_TORCH = {
    "engine/scheduler.py",
    "engine/block_manager.py",
    "engine/types.py",
    "engine/detokenizer.py",
    "engine/config.py",
    "engine/output.py",
    "engine/memory.py",
}
MAX_LINES = 400


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every absolute import in the file, wherever it sits (lazy ones too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
    return out


def _sources():
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            yield pkg, str(f.relative_to(ROOT)), f


def _violations(pkg: str, rel: str, imports) -> list[str]:
    problems = []
    for mod, _ in imports:
        top = mod.split(".")[0]
        if top not in PACKAGES or top == pkg:
            continue
        allowed = {
            "kernels": False,  # imports nothing of ours
            "engine": top == "kernels",  # the kernels only
            "handler": mod == "engine",  # engine's public API: `from engine import ...`
            "warmup": mod in ("engine", "handler.settings"),
        }[pkg]
        if not allowed:
            problems.append(f"{rel} imports {mod}")
    if rel in NO_TORCH and any(m.split(".")[0] in ("torch", "triton", "kernels") for m, _ in imports):
        problems.append(f"{rel} imports torch (the scheduler side stays plain Python)")
    return problems


def test_import_floors():
    problems = [p for pkg, rel, f in _sources() for p in _violations(pkg, rel, _imports(f))]
    assert not problems, problems


def test_the_rules_catch_what_they_forbid():
    """The checker itself: each forbidden edge is reported, each allowed one is not."""
    bad = [
        ("kernels", "kernels/x.py", "engine.types"),
        ("engine", "engine/x.py", "warmup"),
        ("engine", "engine/x.py", "handler.settings"),
        ("handler", "handler/x.py", "engine.llm_engine"),
        ("warmup", "warmup/x.py", "engine.weights"),
        ("warmup", "warmup/x.py", "handler.worker"),
        ("engine", "engine/scheduler.py", "torch"),
    ]
    for pkg, rel, mod in bad:
        assert _violations(pkg, rel, [(mod, [])]), (pkg, mod)
    good = [
        ("engine", "engine/x.py", "kernels"),
        ("handler", "handler/x.py", "engine"),
        ("warmup", "warmup/x.py", "engine"),
        ("warmup", "warmup/x.py", "handler.settings"),
        ("engine", "engine/x.py", "engine.types"),
        ("handler", "handler/x.py", "pydantic"),
    ]
    for pkg, rel, mod in good:
        assert not _violations(pkg, rel, [(mod, [])]), (pkg, mod)


def test_engine_public_api_exists():
    """What handler/ and warmup/ import from `engine` is exported there."""
    import engine

    wanted = {
        name
        for pkg, _, f in _sources()
        if pkg in ("handler", "warmup")
        for mod, names in _imports(f)
        if mod == "engine"
        for name in names
    }
    assert wanted <= set(engine.__all__), wanted - set(engine.__all__)


def test_module_size():
    files = [f for pkg in (*PACKAGES, "bench") for f in (ROOT / pkg).rglob("*.py")]
    big = {str(f.relative_to(ROOT)): n for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_only_settings_reads_the_environment():
    readers = []
    for _, rel, f in _sources():
        src = f.read_text()
        if ("os.environ" in src or "os.getenv" in src) and rel != "handler/settings.py":
            readers.append(rel)
    assert not readers, f"{readers} read the environment; handler/settings.py is the one module that does"
