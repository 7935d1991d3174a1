"""The floors of docs/architecture.md, checked on the source: who may import whom, no import cycle inside a package,
what stays free of torch, module size, and the one module that reads the environment."""

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
    "engine/host_memory.py",  # the automatic CPU pool's size and the machine's memory it is sized from
    "engine/models/spec.py",  # config.json -> ModelSpec: the memory planner and warmup.plan read it without torch
    # the load-balancing server answers its health check before torch is imported (the engine builds on a thread)
    "handler/settings.py",
    "handler/lb.py",
    "handler/healthcheck.py",
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


def _module_name(rel: str) -> str:
    """engine/models/spec.py -> engine.models.spec; engine/models/__init__.py -> engine.models."""
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


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
    if rel in NO_TORCH and any(_is_torch(m) for m, _ in imports):
        problems.append(f"{rel} imports torch (the scheduler side stays plain Python)")
    return problems


def _is_torch(mod: str) -> bool:
    return mod.split(".")[0] in ("torch", "triton", "kernels")


def _load_time_imports(path: Path) -> list[str]:
    """The modules a file imports when it is imported: its top-level imports (in if/try blocks too), not those
    inside functions or under TYPE_CHECKING."""
    out, body = [], list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            body += node.body + node.orelse
        elif isinstance(node, ast.Try):
            body += node.body + node.handlers + node.orelse + node.finalbody
        elif isinstance(node, ast.ExceptHandler):
            body += node.body
    return out


def _torch_reached(rel: str) -> list[str]:
    """The chains by which importing `rel` and calling into it loads torch: its own imports (in functions too),
    then what those load at import time, through our modules."""
    files = {_module_name(r): f for _, r, f in _sources()}
    start = _module_name(rel)
    todo = [(m, [start, m]) for m, _ in _imports(ROOT / rel)]
    seen, chains = set(), []
    while todo:
        mod, chain = todo.pop()
        if _is_torch(mod):
            chains.append(" -> ".join(chain))
        elif mod in files and mod not in seen:
            seen.add(mod)
            todo += [(m, [*chain, m]) for m in _load_time_imports(files[mod])]
    return chains


def test_torch_free_modules_load_no_torch_through_others():
    """A module on the torch-free list also reaches no torch through the modules it imports."""
    problems = {rel: chains for rel in sorted(NO_TORCH) if (chains := _torch_reached(rel))}
    assert not problems, problems


def test_load_time_imports_skip_functions_and_type_checking(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "import a\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b\n"
        "try:\n    import c\nexcept ImportError:\n    import d\ndef f():\n    import e\n"
    )
    assert set(_load_time_imports(f)) == {"a", "typing", "typing.TYPE_CHECKING", "c", "d"}


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


def _import_graph(pkg: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports. Every import counts: module level, inside functions,
    and under TYPE_CHECKING (a type-only edge back still means the two modules cannot be read one after the
    other). `from a.b import c` is an edge to a.b.c when that is a module, else to a.b."""
    mods = {_module_name(rel): f for p, rel, f in _sources() if p == pkg}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, f in mods.items():
        for target, names in _imports(f):
            for dst in [f"{target}.{n}" for n in names if f"{target}.{n}" in mods] or [target]:
                if dst in mods and dst != mod:
                    graph[mod].add(dst)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module: modules that reach each other, each sorted."""

    def reach(v: str) -> set[str]:
        seen, todo = set(), [v]
        while todo:
            for w in graph[todo.pop()] - seen:
                seen.add(w)
                todo.append(w)
        return seen

    reached = {v: reach(v) for v in graph}
    comps = {frozenset({v} | {w for w in reached[v] if v in reached[w]}) for v in graph}
    return sorted(sorted(c) for c in comps if len(c) > 1)


def test_no_import_cycle_inside_a_package():
    """Each package's modules import one another in one direction, so each can be read after what it imports."""
    cycles = [c for pkg in PACKAGES for c in _cycles(_import_graph(pkg))]
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_check_finds_cycles():
    """The checker itself: a cycle through three modules is one component, two cycles are two; a diamond is none."""
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}}
    assert _cycles(cyclic) == [["a", "b", "c"], ["d", "e"]]
    assert _cycles({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) == []


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
