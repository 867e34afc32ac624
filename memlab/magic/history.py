"""Every tracked cell of this kernel: a small record each, a table and a plot."""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

from memlab.reports.frame import CELL, heading, note, num_cell, table, text_cell
from memlab.reports.protocol import Result
from memlab.reports.report import MemoryReport
from memlab.reports.units import fmt_bytes, fmt_label, fmt_seconds

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The history keeps the most recent this-many cells (a few hundred bytes each).
MAX_ENTRIES = 10_000
#: The table (text and HTML) shows the most recent this-many cells; `to_dict` has them all.
MAX_ROWS = 50


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
        return fmt_label(self.label) if self.label else f"[{self.cell}]"


class History(Result):
    """The tracked cells of this kernel, oldest first (``%gpumem_history``)."""

    css = "memlab-history"

    def __init__(self) -> None:
        self.entries: deque[Entry] = deque(maxlen=MAX_ENTRIES)
        self.dropped = 0  # the oldest cells, forgotten past MAX_ENTRIES

    def add(self, cell: int, report: MemoryReport) -> None:
        if len(self.entries) == self.entries.maxlen:
            self.dropped += 1
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
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.entries)

    def to_dict(self) -> dict[str, Any]:
        return {"cells": [e._asdict() for e in self.entries], "dropped": self.dropped}

    def _shown(self) -> tuple[list[Entry], str | None]:
        """The most recent `MAX_ROWS` cells, and a line on what is not shown (None: nothing)."""
        rows = list(itertools.islice(reversed(self.entries), MAX_ROWS))[::-1]
        hidden = len(self.entries) - len(rows)
        if not hidden and not self.dropped:
            return rows, None
        parts = []
        if hidden:
            parts.append(
                f"{hidden:,} earlier cell(s) not shown here (the plot and .to_dict() have them)"
            )
        if self.dropped:
            parts.append(
                f"{self.dropped:,} older cell(s) forgotten (the last {MAX_ENTRIES:,} are kept)"
            )
        return rows, "; ".join(parts) + "; %gpumem_history --clear starts afresh"

    def plot(self) -> Figure:
        from memlab.reports.plot import plot_history

        if not self.entries:
            raise ValueError("The history is empty: run a cell with %%gpumem first.")
        es = list(self.entries)
        return plot_history([e.name for e in es], [e.after for e in es], [e.peak for e in es])

    def text(self) -> str:
        if not self.entries:
            return "memlab history: no tracked cells yet."
        rows, hidden = self._shown()
        w = max(6, *(len(e.name) for e in rows))
        head = f"{'cell':>{w}}  {'device':<8}{'after':>11}{'change':>12}{'peak':>11}{'time':>10}"
        lines = ["memlab history", head]
        if hidden:
            lines.insert(1, f"  note: {hidden}")
        for e in rows:
            lines.append(
                f"{e.name:>{w}}  {e.device:<8}{fmt_bytes(e.after):>11}"
                f"{fmt_bytes(e.after - e.before, signed=True):>12}{fmt_bytes(e.peak):>11}"
                f"{fmt_seconds(e.seconds):>10}" + (f"  raised {e.raised}" if e.raised else "")
            )
        return "\n".join(lines)

    def html(self) -> str:
        if not self.entries:
            return heading("memlab history: no tracked cells yet.")
        shown, hidden = self._shown()
        rows = [
            text_cell(e.name)
            + text_cell(e.device)
            + num_cell(e.after)
            + num_cell(e.after - e.before, signed=True, colour=True)
            + num_cell(e.peak)
            + text_cell(fmt_seconds(e.seconds), CELL)
            + text_cell(e.raised or "")
            for e in shown
        ]
        head = ["cell", "device", "allocated after", "change", "peak", "time", "raised"]
        body = heading("memlab history") + table(head, rows, "memlab-history-table")
        return body + (note(hidden) if hidden else "")
