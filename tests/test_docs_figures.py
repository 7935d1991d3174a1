"""Every measured figure in README.md and docs/*.md has a producer: the bench command that printed it and the
CPU it ran on, written beside it.

- A section a bench writes (`<!-- key:start -->` … `<!-- key:end -->`) names its command (`python -m bench.X` or
  `python bench/X.py`), that bench exists and writes that section, and the section names the machine.
- Anywhere else, a paragraph (a bullet, a table row) holding a measured figure (a speed-up, a percentage, a
  time, a rate) names a bench that exists and prints that kind of figure, and the CPU it ran on. A figure that
  is not a measurement (a default, a limit, a target) is listed in NOT_MEASURED with what it is.

A new figure with no producer fails here: measure it with a bench, or remove it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SECTION = re.compile(r"<!-- ([\w-]+):start -->(.*?)<!-- \1:end -->", re.S)
BENCH = re.compile(r"python -m bench\.(\w+)|python bench/(\w+)\.py|\bbench[./](\w+)(?:\.py)?")
CPU = re.compile(r"AMD EPYC|Intel|Xeon|Apple M\d|Graviton|Ampere|Neoverse")
# measured kinds: the figure's pattern, and what the bench's source must contain to print that kind
KINDS = {
    "speed-up": (re.compile(r"\d+(?:[.,]\d+)*[x×](?![\w.])"), re.compile(r"\}\s?[x×]|[x×]\"|x\b.*ratio|ratio")),
    "percent": (re.compile(r"\d+(?:[.,]\d+)*\s?%"), re.compile(r"%\}|%\"|\} ?%|:\.?\d*%")),
    "time": (re.compile(r"\d+(?:[.,]\d+)*\s?(?:ms|s)\b(?!/)"), re.compile(r"\bms\b|\} s\b| s\"|seconds|perf_counter")),
    "rate": (
        re.compile(r"\d+(?:[.,]\d+)*\s?(?:tok/s|GFLOP/s|[GM]i?B/s|req/s)"),
        re.compile(r"tok/s|GFLOP/s|B/s|req/s"),
    ),
}
# Figures in prose that are not measurements, each with what it is. Keyed by the figure's text in its doc.
NOT_MEASURED = {
    ("docs/decisions.md", "300 s"): "distributed_timeout_s's default",
    ("docs/decisions.md", "30 s"): "the out-of-memory limits' recovery period (engine/scheduler.py OOM_RECOVERY_S)",
    ("docs/decisions.md", "900 s"): "the emulator's result retention (handler/job_front.py)",
}
TARGET = re.compile(r"(?:>=|<=|≥|≤|[<>]|target[^.|]*?|within|at most|at least|under)\s*$", re.I)


def _blocks(text: str):
    """Paragraphs, bullets and table rows, outside bench-written sections and code blocks, with their line."""
    text = SECTION.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    block, start = [], 0
    for i, line in enumerate(text.split("\n") + [""], 1):
        new = not line.strip() or line.lstrip().startswith(("- ", "* ", "|")) or re.match(r"\s*\d+\. ", line)
        if new and block:
            yield start, " ".join(block)
            block = []
        if line.strip():
            if not block:
                start = i
            block.append(line.strip())


def _bench_source(name: str) -> str | None:
    f = REPO / "bench" / f"{name}.py"
    return f.read_text() if f.is_file() else None


def _measured(doc: str, para: str):
    for kind, (pat, _) in KINDS.items():
        for m in pat.finditer(para):
            fig = m.group(0)
            if (doc, fig) in NOT_MEASURED or TARGET.search(para[: m.start()][-40:]):
                continue
            yield kind, fig


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_bench_sections_name_their_producer_and_machine(doc):
    for key, body in SECTION.findall(doc.read_text()):
        cmd = re.search(r"python -m bench\.(\w+)|python bench/(\w+)\.py", body)
        assert cmd, f"{doc.name} section {key!r} names no bench command"
        name = cmd.group(1) or cmd.group(2)
        src = _bench_source(name)
        assert src is not None, f"{doc.name} section {key!r}: bench/{name}.py does not exist"
        assert f'"{key}"' in src and "write_section" in src, f"bench/{name}.py does not write section {key!r}"
        assert CPU.search(body) or "NVIDIA" in body, f"{doc.name} section {key!r} names no machine"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_measured_figure_has_a_producer(doc):
    rel = str(doc.relative_to(REPO))
    bad = []
    for line, para in _blocks(doc.read_text()):
        figs = list(_measured(rel, para))
        if not figs:
            continue
        names = [next(g for g in m.groups() if g) for m in BENCH.finditer(para)]
        sources = {n: _bench_source(n) for n in names}
        if not names or None in sources.values():
            bad.append(f"{rel}:{line}: {figs[0][1]!r} names no existing bench ({names or 'none'}): {para[:100]}")
        elif not CPU.search(para):
            bad.append(f"{rel}:{line}: {figs[0][1]!r} (bench.{names[0]}) names no CPU: {para[:100]}")
        else:
            for kind, fig in figs:
                if not any(KINDS[kind][1].search(src) for src in sources.values()):
                    bad.append(f"{rel}:{line}: {fig!r} is a {kind}, which {names} never print")
    assert not bad, "\n".join(bad)


def test_the_scan_can_fail(tmp_path):
    """A made-up figure with no producer, and one naming a bench that does not exist, are both caught."""
    text = "Speed:\n\n- it is 3.5x faster than the rest.\n- loads in 12 ms (bench/nonexistent.py, AMD EPYC).\n"
    found = [(n, list(_measured("x.md", p))) for n, p in _blocks(text)]
    assert [f for _, fs in found for f in fs] == [("speed-up", "3.5x"), ("time", "12 ms")]
    assert _bench_source("nonexistent") is None and _bench_source("spec") is not None


def test_not_measured_entries_are_in_their_docs():
    """The list of figures that are not measurements holds no stale entry."""
    for (doc, fig), what in NOT_MEASURED.items():
        assert fig in (REPO / doc).read_text(), f"{doc} no longer says {fig!r} ({what}): drop it from NOT_MEASURED"
