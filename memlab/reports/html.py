"""HTML rendering for notebooks: compact, human units, exact bytes on hover, growth in colour.

Inline styles only (JupyterLab keeps them in trusted output; a ``<style>`` block would leak into
the page). Every user-supplied string is escaped.
"""

from __future__ import annotations

from html import escape

from memlab.reports.layout import layout
from memlab.reports.report import MemoryReport
from memlab.reports.units import fmt_bytes

GROW, SHRINK, FLAT = "#b03a2e", "#1e8449", "#7f8c8d"
#: Cell styles shared by every memlab table. Explicit alignment: JupyterLab right-aligns cells.
CELL = "padding:1px 8px;text-align:right;font-variant-numeric:tabular-nums"
HEAD = "padding:1px 8px;text-align:right;font-weight:600;color:#555"
NAME = "padding:1px 8px 1px 0;text-align:left"
LEFT = "padding:1px 8px;text-align:left"


def num_cell(n: int | None, signed: bool = False, colour: bool = False) -> str:
    """A byte count in human units, the exact bytes on hover; growth in red, shrinking in green."""
    if n is None:
        return f'<td style="{CELL};color:{FLAT}">n/a</td>'
    style = CELL
    if colour:
        style += f";font-weight:600;color:{GROW if n > 0 else SHRINK if n < 0 else FLAT}"
    return f'<td style="{style}" title="{n:,} B">{escape(fmt_bytes(n, signed=signed))}</td>'


def text_cell(text: str, style: str = LEFT) -> str:
    return f'<td style="{style}">{escape(text)}</td>'


def table(head: list[str], rows: list[str], cls: str) -> str:
    """A compact table: ``rows`` are ``<td>`` strings (one string per row)."""
    th = "".join(f'<th style="{LEFT}">{escape(h)}</th>' for h in head)
    body = "".join(f"<tr>{r}</tr>" for r in rows)
    return (
        f'<table class="{cls}" style="border-collapse:collapse;font-size:12px">'
        f"<tr>{th}</tr>{body}</table>"
    )


def render_html(r: MemoryReport) -> str:
    lay = layout(r)
    out = [
        '<div class="memlab-report" style="font-family:system-ui,sans-serif;font-size:12px;'
        'line-height:1.35;margin:4px 0">',
        f'<div><b>{escape(lay.title)}</b> <span style="color:#777">'
        f"({escape(lay.subtitle)})</span></div>",
        '<table style="border-collapse:collapse;margin:2px 0">',
        "<tr><th></th>"
        + "".join(
            f'<th style="{HEAD}">{h}</th>'
            for h in ("before", "after", "change", "peak", "peak − before")
        )
        + "</tr>",
    ]
    for row in lay.rows:
        out.append(
            f'<tr><td style="{NAME};font-weight:600">{row.name}</td>'
            + num_cell(row.before)
            + num_cell(row.after)
            + num_cell(row.delta, signed=True, colour=True)
            + num_cell(row.peak)
            + num_cell(row.peak_delta, signed=True, colour=True)
            + "</tr>"
        )
    out.append("</table>")
    if lay.categories:
        out.append(
            '<table style="border-collapse:collapse;margin:2px 0">'
            f'<tr><th style="{HEAD};text-align:left">category</th>'
            f'<th style="{HEAD}">at peak</th><th style="{HEAD}">at end</th></tr>'
        )
        for c in lay.categories:
            out.append(
                f'<tr><td style="{NAME}" title="{escape(c.description)}">'
                f"{escape(c.category.value.replace('_', ' '))}</td>"
                + num_cell(c.at_peak)
                + num_cell(c.at_end)
                + "</tr>"
            )
        out.append("</table>")
    for note in lay.notes:
        out.append(f'<div style="color:#555">{escape(note)}</div>')
    out.append("</div>")
    return "\n".join(out)
