"""The interactive timeline: zoom, pan, hover an allocation; drawn by Bokeh, offline.

Bokeh draws it (why Bokeh: docs/snapshots.md): its JavaScript is put inline in the output, once
per chart (about 1.4 MiB), so the chart needs no network: it works air-gapped, in JupyterLab,
Notebook 7, VS Code and in a notebook exported to HTML. A million events are reduced before
drawing: the lowest and highest point of each of a few thousand runs of events are kept, so the
peak is always drawn; the categories are stacked (memory by the phase that allocated it); the
largest allocations are points to hover, with their size, category, shape and source line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any, Literal

import numpy as np

from memlab.core.frames import users_traceback
from memlab.reports.units import fmt_bytes
from memlab.snapshot.trace import GROUPS, HOVER_ALLOCATIONS, Trace, reduce
from memlab.snapshot.write import opened, writable

#: Points drawn for the stacked areas, whatever the number of events.
POINTS = 6_000
#: "canvas": drawn by the browser's 2D canvas, which needs no GPU (WebGL without one is slower).
BACKEND: Literal["canvas", "svg", "webgl"] = "canvas"
#: Bottom to top, one per group: muted for what was there before, then the phases.
COLOURS = ("#95a5a6", "#2e86c1", "#e67e22", "#8e44ad", "#16a085")
#: Stacking order, bottom first: what lives longest at the bottom, activations on top.
STACK = (0, 3, 4, 2, 1)
#: Axis text and lines that read on light and dark notebook themes alike.
INK = "#8a8a8a"


@dataclass(frozen=True)
class Chart:
    """An interactive timeline; displays itself in a notebook, ``save(path)`` writes a page."""

    title: str
    item: str  # Bokeh's JSON for the figure
    events: int
    points: int

    def _script(self, target: str) -> str:
        from bokeh.resources import Resources

        js = "\n".join(Resources(mode="inline", components=["bokeh"]).js_raw)
        # the JSON holds the user's strings (file names, functions): "</script>" in one would
        # end this script early, so every "<" is written as JSON's own escape for it
        item = self.item.replace("<", "\\u003c")
        # Wait until the output is in the page: a notebook front end may run the script before
        # it attaches the output's element.
        embed = (
            f"(function(){{const item={item};let tries=0;function go(){{"
            f"const el=document.getElementById({json.dumps(target)});"
            "if(el&&el.isConnected&&window.Bokeh){Bokeh.embed.embed_item(item,el);}"
            "else if(tries++<200){setTimeout(go,50);}}go();})();"
        )
        return f"<script>{js}</script>\n<script>{embed}</script>"

    def html(self) -> str:
        """The chart as an HTML fragment, its JavaScript inline."""
        target = f"memlab-chart-{id(self):x}-{np.random.randint(1 << 30):x}"
        return (
            f'<div class="memlab memlab-chart" data-events="{self.events}" '
            f'data-points="{self.points}"><div id="{target}" style="width:100%"></div></div>\n'
            f"{self._script(target)}"
        )

    def _repr_html_(self) -> str:
        return self.html()

    @users_traceback()
    def save(self, path: str | os.PathLike[str]) -> Path:
        """A standalone HTML page (no network needed to open it)."""
        p = writable(path, "chart.html")
        with opened(p, binary=False) as f:
            f.write(
                f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(self.title)}"
                f"</title></head><body>{self.html()}</body></html>"
            )
        return p


def _scale(largest: float) -> tuple[float, str]:
    for div, unit in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if largest >= 2 * div:
            return float(div), unit
    return 1.0, "B"


def _steps(x: Any, ys: Any) -> tuple[Any, Any]:
    """A step function's corners: each value holds until the next point."""
    xs = np.repeat(x, 2)[1:]
    return xs, [np.repeat(y, 2)[:-1] for y in ys]


def chart_of_trace(t: Trace, title: str, points: int = POINTS) -> Chart:
    """The interactive chart of a `Trace`."""
    from bokeh.embed import json_item
    from bokeh.models import ColumnDataSource, HoverTool
    from bokeh.models.annotations import Label
    from bokeh.plotting import figure

    n = len(t.times)
    if not n:
        raise ValueError(
            f"{title} has no allocations or frees to draw: record them with "
            "torch.cuda.memory._record_memory_history() before the code, then _dump_snapshot()."
        )
    keep = reduce(t.totals, points)
    div, unit = _scale(float(t.peak))
    stacked = t.by_group(keep) / div
    present = [g for g in STACK if stacked[g].any()] or [0]
    xs, ys = _steps(t.times[keep], [stacked[g] for g in present])
    fig = figure(
        height=320,
        sizing_mode="stretch_width",
        tools="xpan,xwheel_zoom,box_zoom,reset,save",
        active_scroll="xwheel_zoom",
        output_backend=BACKEND,
        title=title,
        x_axis_label="seconds since the trace began" if t.timed else "event",
        y_axis_label=unit,
    )
    names = [GROUPS[g] for g in present]
    area = ColumnDataSource({"x": xs, **{name: y for name, y in zip(names, ys, strict=True)}})
    fig.varea_stack(
        stackers=names,
        x="x",
        source=area,
        color=[COLOURS[g] for g in present],
        legend_label=[f"made in {n}" if n in GROUPS[1:] else n for n in names],
        alpha=0.85,
    )
    _allocations(fig, t, div, HoverTool, ColumnDataSource)
    # the peak, marked
    i = int(t.totals.argmax())
    fig.scatter(
        [t.times[i]], [t.totals[i] / div], marker="inverted_triangle", size=12, color="#c0392b"
    )
    fig.add_layout(
        Label(
            x=float(t.times[i]),
            y=float(t.totals[i] / div),
            text=f"peak {fmt_bytes(int(t.totals[i]))}",
            text_color="#c0392b",
            text_font_size="11px",
            x_offset=8,
            y_offset=4,
        )
    )
    fig.y_range.start = 0  # type: ignore[attr-defined]
    fig.y_range.end = max(float(t.totals[i] / div) * 1.12, 1.0)  # type: ignore[attr-defined]
    _theme(fig)
    return Chart(title=title, item=json.dumps(json_item(fig)), events=n, points=len(xs))


def _allocations(fig: Any, t: Trace, div: float, hover: Any, source: Any) -> None:
    """The largest allocations as points at the moment each was made, to hover."""
    made = np.flatnonzero((t.owner >= 0) & (t.deltas > 0))
    if not len(made):
        return
    order = spread(t.a_size, HOVER_ALLOCATIONS)
    at = np.empty(len(t.a_size), dtype=np.int64)
    at[t.owner[made]] = made
    ev = at[order]
    src = source(
        {
            "x": t.times[ev],
            "y": t.totals[ev] / div,
            "size": [fmt_bytes(int(s)) for s in t.a_size[order]],
            "bytes": [f"{int(s):,}" for s in t.a_size[order]],
            "category": [GROUPS[int(g)] for g in t.a_group[order]],
            "shape": [t.a_shape.get(int(k), "not recorded") for k in order],
            "line": [t.lines[int(k)] or "no frames" for k in t.a_line[order]],
            "freed": ["live at the end" if np.isnan(e) else f"{e:.6g}" for e in t.a_end[order]],
        }
    )
    src.data["colour"] = [COLOURS[int(g)] for g in t.a_group[order]]
    dots = fig.scatter(
        "x", "y", source=src, size=5, color="colour", line_color=INK, alpha=0.35,
        hover_alpha=1.0, hover_line_color="#c0392b",
    )  # fmt: skip
    fig.add_tools(
        hover(
            renderers=[dots],
            tooltips=[
                ("size", "@size (@bytes B)"),
                ("category", "@category"),
                ("shape", "@shape"),
                ("source line", "@line"),
                ("made at", "@x{0.000000}"),
                ("freed at", "@freed"),
            ],
        )
    )


def spread(sizes: Any, n: int, biggest: int = 20) -> Any:
    """Indices of up to ``n`` allocations to hover: the ``biggest`` of all, and the biggest of
    each of the other ``n - biggest`` runs in allocation order (every stretch of time has one)."""
    if len(sizes) <= n:
        return np.arange(len(sizes))
    runs = n - biggest
    width = -(-len(sizes) // runs)
    padded = np.concatenate([sizes, np.full(width * runs - len(sizes), -1)])
    local = np.arange(runs) * width + padded.reshape(runs, width).argmax(axis=1)
    top = np.argsort(-sizes, kind="stable")[:biggest]
    return np.unique(np.concatenate([local[local < len(sizes)], top]))


def _theme(fig: Any) -> None:
    """Transparent, with grey text: readable on a light or a dark notebook."""
    fig.background_fill_alpha = 0
    fig.border_fill_alpha = 0
    fig.outline_line_alpha = 0
    fig.title.text_color = INK
    for axis in (*fig.xaxis, *fig.yaxis):
        axis.axis_label_text_color = axis.major_label_text_color = INK
        axis.axis_line_color = axis.major_tick_line_color = axis.minor_tick_line_color = INK
    fig.grid.grid_line_alpha = 0.25
    fig.add_layout(fig.legend[0], "right")  # beside the plot, never over the curve
    fig.legend.background_fill_alpha = 0.0
    fig.legend.border_line_alpha = 0.0
    fig.legend.label_text_color = INK
    fig.legend.click_policy = "hide"
