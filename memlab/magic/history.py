"""Every tracked cell of this kernel: a small record each, a table and a plot."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

from memlab.reports.frame import CELL, heading, num_cell, table, text_cell
from memlab.reports.protocol import Result
from memlab.reports.report import MemoryReport
from memlab.reports.units import fmt_bytes, fmt_seconds

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The history keeps the most recent this-many cells (a few hundred bytes each).
MAX_ENTRIES = 10_000


class Entry(NamedTuple):
    cell: int
    label: str
    device: str
    source: str
    before: int
    after: int
    peak: int
    seconds: float
    raised: str | None

    @property
    def name(self) -> str:
        return self.label or f"[{self.cell}]"


class History(Result):
    """The tracked cells of this kernel, oldest first (``%gpumem_history``)."""

    css = "memlab-history"

    def __init__(self) -> None:
        self.entries: deque[Entry] = deque(maxlen=MAX_ENTRIES)

    def add(self, cell: int, report: MemoryReport) -> None:
        self.entries.append(
            Entry(
                cell,
                report.label or "",
                report.device,
                report.source,
                report.allocated_before,
                report.allocated_after,
                report.peak_allocated,
                report.seconds,
                report.raised,
            )
        )

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)

    def to_dict(self) -> dict[str, Any]:
        return {"cells": [e._asdict() for e in self.entries]}

    def plot(self) -> Figure:
        from memlab.reports.plot import plot_history

        if not self.entries:
            raise ValueError("The history is empty: run a cell with %%gpumem first.")
        es = list(self.entries)
        return plot_history([e.name for e in es], [e.after for e in es], [e.peak for e in es])

    def text(self) -> str:
        if not self.entries:
            return "memlab history: no tracked cells yet."
        w = max(6, *(len(e.name) for e in self.entries))
        head = f"{'cell':>{w}}  {'device':<8}{'after':>11}{'change':>12}{'peak':>11}{'time':>10}"
        lines = ["memlab history", head]
        for e in self.entries:
            lines.append(
                f"{e.name:>{w}}  {e.device:<8}{fmt_bytes(e.after):>11}"
                f"{fmt_bytes(e.after - e.before, signed=True):>12}{fmt_bytes(e.peak):>11}"
                f"{fmt_seconds(e.seconds):>10}" + (f"  raised {e.raised}" if e.raised else "")
            )
        return "\n".join(lines)

    def html(self) -> str:
        if not self.entries:
            return heading("memlab history: no tracked cells yet.")
        rows = [
            text_cell(e.name)
            + text_cell(e.device)
            + num_cell(e.after)
            + num_cell(e.after - e.before, signed=True, colour=True)
            + num_cell(e.peak)
            + text_cell(fmt_seconds(e.seconds), CELL)
            + text_cell(e.raised or "")
            for e in self.entries
        ]
        head = ["cell", "device", "allocated after", "change", "peak", "time", "raised"]
        return heading("memlab history") + table(head, rows, "memlab-history-table")
