"""The one HTML frame every memlab result is drawn in, and the pieces its bodies are made of.

Inline styles only (JupyterLab keeps them in trusted output; a ``<style>`` block would leak into
the page). Text takes the notebook's own colour, so it reads on light and dark themes; muted text
uses JupyterLab's variable for it, with a grey that reads on both as the fallback. Every string
given to these functions is escaped here; only ``body`` and ``rows`` are HTML already.
"""

from __future__ import annotations

from html import escape

from memlab.reports.units import fmt_bytes

#: Growth in red, shrinking in green, no change in grey: dark enough on white, light enough on
#: a dark theme for bold figures.
#: Growth, shrinking, no change: colours that read on JupyterLab's light and dark backgrounds
#: alike (contrast 3.7 or more on white and on the dark theme's #212121).
GROW, SHRINK, FLAT = "#d9463b", "#1e8449", "#7f8c8d"
MUTED = "var(--jp-content-font-color2,#888)"
#: Cell styles shared by every memlab table. Explicit alignment: JupyterLab right-aligns cells.
CELL = "padding:1px 8px;text-align:right;font-variant-numeric:tabular-nums"
HEAD = f"padding:1px 8px;text-align:right;font-weight:600;color:{MUTED}"
NAME = "padding:1px 8px 1px 0;text-align:left"
LEFT = "padding:1px 8px;text-align:left"
FRAME = "font-family:system-ui,sans-serif;font-size:12px;line-height:1.35;margin:4px 0"


def frame(body: str, css: str) -> str:
    """The outer box of a result: ``<div class="memlab memlab-...">``, the font, the margins."""
    return f'<div class="memlab {escape(css)}" style="{FRAME}">\n{body}\n</div>'


def heading(title: str, subtitle: str | None = None) -> str:
    """A result's first line: the title in bold, what it means muted in parentheses."""
    sub = f' <span style="color:{MUTED}">({escape(subtitle)})</span>' if subtitle else ""
    return f"<div><b>{escape(title)}</b>{sub}</div>"


def note(text: str) -> str:
    return f'<div style="color:{MUTED}">{escape(text)}</div>'


def warning(text: str) -> str:
    """A line that needs attention: out of memory, does not fit."""
    return f'<div style="color:{GROW};font-weight:600">{escape(text)}</div>'


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


def code_cell(text: str, style: str = LEFT) -> str:
    """A cell of text whose code is marked `like this`: escaped, the code in ``<code>``."""
    parts = escape(text).split("`")
    body = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    return f'<td style="{style}">{body}</td>'


def plain(text: str) -> str:
    """Text whose code is marked `like this`, as plain text (the marks dropped)."""
    return text.replace("`", "")


def table(head: list[str], rows: list[str], cls: str) -> str:
    """A compact table: ``rows`` are ``<td>`` strings (one string per row)."""
    th = "".join(f'<th style="{LEFT}">{escape(h)}</th>' for h in head)
    body = "".join(f"<tr>{r}</tr>" for r in rows)
    return (
        f'<table class="{escape(cls)}" style="border-collapse:collapse;font-size:12px">'
        f"<tr>{th}</tr>{body}</table>"
    )
