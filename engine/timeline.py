"""A start-up timeline: named phases with their seconds, printed as one table and returned as JSON.

Generic on purpose: `python -m warmup` times its steps with it, and the worker can time its cold start
(imports, settings, model resolution, weight read, ..., ready, first token) the same way. Two ways to record:
`with tl.phase(name):` around a block, or `tl.mark(name)` when code cannot be wrapped: the phase ends now and
began where the previous entry ended (or at the start), so a run of marks tiles the time with no gaps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Phase:
    name: str
    start: float  # seconds since the timeline's start
    seconds: float = 0.0
    note: str = ""  # e.g. "1.2 GB at 800 MB/s", or why it was skipped

    @property
    def end(self) -> float:
        return self.start + self.seconds


class Timeline:
    def __init__(self, start: float | None = None, clock: Callable[[], float] = time.perf_counter):
        # `start` lets the worker count from before its own imports (a clock() value taken earlier)
        self._clock = clock
        self._t0 = clock() if start is None else start
        self.phases: list[Phase] = []

    def _now(self) -> float:
        return self._clock() - self._t0

    @contextmanager
    def phase(self, name: str, note: str = "") -> Iterator[Phase]:
        """Time the block; the yielded Phase's `note` may be set inside it. Recorded even if the block raises,
        so a failed start still shows where its time went."""
        p = Phase(name, self._now(), note=note)
        try:
            yield p
        finally:
            p.seconds = self._now() - p.start
            self.phases.append(p)

    def mark(self, name: str, note: str = "") -> Phase:
        """The phase `name` ends now; it began where the previous entry ended."""
        begin = self.phases[-1].end if self.phases else 0.0
        p = Phase(name, begin, self._now() - begin, note)
        self.phases.append(p)
        return p

    def skip(self, name: str, reason: str) -> Phase:
        """A step that did not run: zero seconds, the reason shown in the table. It sits where the previous
        entry ended, so the next mark still covers everything since then and marks keep tiling the time."""
        p = Phase(name, self.phases[-1].end if self.phases else 0.0, 0.0, f"skipped: {reason}")
        self.phases.append(p)
        return p

    def total(self) -> float:
        """Wall time from the start to the end of the last entry (not the sum: phases may leave gaps)."""
        return max((p.end for p in self.phases), default=0.0)

    def as_dict(self) -> dict:
        return {
            "total_s": round(self.total(), 4),
            "phases": [
                {
                    "name": p.name,
                    "start_s": round(p.start, 4),
                    "seconds": round(p.seconds, 4),
                    **({"note": p.note} if p.note else {}),
                }
                for p in self.phases
            ],
        }

    def table(self) -> str:
        total = self.total()
        rows = [
            (
                p.name,
                f"{p.seconds:.2f}",
                f"{100 * p.seconds / total:.0f}%" if total > 0 else "-",
                f"{p.end:.2f}",
                p.note,
            )
            for p in self.phases
        ]
        rows.append(("total", f"{total:.2f}", "100%" if total > 0 else "-", "", ""))
        head = ("phase", "seconds", "%", "at", "")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]

        def fmt(r) -> str:
            cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:4], widths[1:])]
            return "  ".join(cells + ([r[4]] if r[4] else [])).rstrip()

        return "\n".join([fmt(head), *(fmt(r) for r in rows)])
