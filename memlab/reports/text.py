"""Plain-text rendering, for terminals and logs: the cell report, and columns for every result."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from memlab.reports.layout import layout
from memlab.reports.units import fmt_bytes

if TYPE_CHECKING:
    from memlab.reports.report import MemoryReport


def columns(
    head: Sequence[str], rows: Sequence[Sequence[str]], align: str = "", indent: int = 2
) -> list[str]:
    """Aligned lines, two spaces between columns. ``align`` has one letter per column, ``l`` or
    ``r``; by default the first column is left-aligned and the others right-aligned (figures)."""
    lines = [head, *rows]
    align = align or "l" + "r" * (len(head) - 1)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return [
        " " * indent
        + "  ".join(
            c.ljust(w) if a == "l" else c.rjust(w)
            for c, w, a in zip(line, widths, align, strict=True)
        ).rstrip()
        for line in lines
    ]


def render_text(r: MemoryReport) -> str:
    lay = layout(r)
    lines = [f"{lay.title}  [{lay.subtitle}]"]
    head = ("", "before", "after", "change", "peak", "peak-before")
    rows = [
        (
            row.name,
            fmt_bytes(row.before),
            fmt_bytes(row.after),
            fmt_bytes(row.delta, signed=True),
            fmt_bytes(row.peak),
            fmt_bytes(row.peak_delta, signed=True),
        )
        for row in lay.rows
    ]
    lines += columns(head, rows)
    if lay.categories:
        lines.append(f"  {'breakdown':<17}{'at peak':>11}  {'at end':>11}")
        for c in lay.categories:
            lines.append(
                f"    {c.category.value:<15}{fmt_bytes(c.at_peak):>11}  {fmt_bytes(c.at_end):>11}"
            )
    lines.extend(f"  note: {n}" for n in lay.notes)
    return "\n".join(lines)
