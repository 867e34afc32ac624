"""Plain-text rendering, for terminals and logs."""

from __future__ import annotations

from memlab.reports.layout import layout
from memlab.reports.report import MemoryReport
from memlab.reports.units import fmt_bytes


def render_text(r: MemoryReport) -> str:
    lay = layout(r)
    lines = [f"{lay.title}  [{lay.subtitle}]"]
    head = ("", "before", "after", "change", "peak", "peak-before")
    table = [head]
    for row in lay.rows:
        table.append(
            (
                row.name,
                fmt_bytes(row.before),
                fmt_bytes(row.after),
                fmt_bytes(row.delta, signed=True),
                fmt_bytes(row.peak),
                fmt_bytes(row.peak_delta, signed=True),
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    for line in table:
        cells = [line[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True)
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    if lay.categories:
        lines.append(f"  {'breakdown':<17}{'at peak':>11}  {'at end':>11}")
        for c in lay.categories:
            lines.append(
                f"    {c.category.value:<15}{fmt_bytes(c.at_peak):>11}  {fmt_bytes(c.at_end):>11}"
            )
    lines.extend(f"  note: {n}" for n in lay.notes)
    return "\n".join(lines)
