"""The HTML body of a cell report: compact, human units, exact bytes on hover, growth in colour.

`MemoryReport._repr_html_` draws it in the one frame (`memlab.reports.frame`).
"""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

from memlab.reports.frame import HEAD, NAME, heading, note, num_cell, text_cell
from memlab.reports.layout import layout

if TYPE_CHECKING:
    from memlab.reports.report import MemoryReport


def render_html(r: MemoryReport) -> str:
    lay = layout(r)
    out = [
        heading(lay.title, lay.subtitle),
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
            "<tr>"
            + text_cell(row.name, f"{NAME};font-weight:600")
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
    out.extend(note(n) for n in lay.notes)
    return "\n".join(out)
