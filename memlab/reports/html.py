"""HTML rendering for notebooks: compact, human units, exact bytes on hover, growth in colour.

Inline styles only (JupyterLab keeps them in trusted output; a ``<style>`` block would leak into
the page). Every user-supplied string is escaped.
"""

from __future__ import annotations

from html import escape

from memlab.reports.layout import layout
from memlab.reports.report import MemoryReport
from memlab.reports.units import fmt_bytes

_GROW, _SHRINK, _FLAT = "#b03a2e", "#1e8449", "#7f8c8d"
_CELL = "padding:1px 8px;text-align:right;font-variant-numeric:tabular-nums"
_HEAD = "padding:1px 8px;text-align:right;font-weight:600;color:#555"
_NAME = "padding:1px 8px 1px 0;text-align:left"  # explicit: JupyterLab right-aligns table cells


def _num(n: int | None, signed: bool = False, colour: bool = False) -> str:
    if n is None:
        return f'<td style="{_CELL};color:{_FLAT}">n/a</td>'
    style = _CELL
    if colour:
        style += f";font-weight:600;color:{_GROW if n > 0 else _SHRINK if n < 0 else _FLAT}"
    return f'<td style="{style}" title="{n:,} B">{escape(fmt_bytes(n, signed=signed))}</td>'


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
            f'<th style="{_HEAD}">{h}</th>'
            for h in ("before", "after", "change", "peak", "peak − before")
        )
        + "</tr>",
    ]
    for row in lay.rows:
        out.append(
            f'<tr><td style="{_NAME};font-weight:600">{row.name}</td>'
            + _num(row.before)
            + _num(row.after)
            + _num(row.delta, signed=True, colour=True)
            + _num(row.peak)
            + _num(row.peak_delta, signed=True, colour=True)
            + "</tr>"
        )
    out.append("</table>")
    if lay.categories:
        out.append(
            '<table style="border-collapse:collapse;margin:2px 0">'
            f'<tr><th style="{_HEAD};text-align:left">category</th>'
            f'<th style="{_HEAD}">at peak</th><th style="{_HEAD}">at end</th></tr>'
        )
        for c in lay.categories:
            out.append(
                f'<tr><td style="{_NAME}" title="{escape(c.description)}">'
                f"{escape(c.category.value.replace('_', ' '))}</td>"
                + _num(c.at_peak)
                + _num(c.at_end)
                + "</tr>"
            )
        out.append("</table>")
    for note in lay.notes:
        out.append(f'<div style="color:#555">{escape(note)}</div>')
    out.append("</div>")
    return "\n".join(out)
