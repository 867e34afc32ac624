"""What the panel draws: the table of runs and the chart of their peaks by category."""

from __future__ import annotations

import io
from html import escape
from typing import Any

from memlab.core.categories import Category
from memlab.reports.html import CELL, GROW, LEFT, num_cell, table, text_cell
from memlab.reports.units import fmt_seconds
from memlab.step.result import RunResult

MiB = 1024**2
_COLOURS = {
    Category.PARAMETER: "#1f4e79",
    Category.BUFFER: "#5b9bd5",
    Category.OPTIMIZER_STATE: "#7030a0",
    Category.GRADIENT: "#c55a11",
    Category.INPUT: "#70ad47",
    Category.ACTIVATION: "#e8a33d",
    Category.TEMPORARY: "#bfbfbf",
    Category.OTHER: "#7f7f7f",
    Category.UNATTRIBUTED: "#d9d9d9",
}


def runs_table(results: list[RunResult]) -> str:
    if not results:
        return ""
    # like with like: a measured run against the first measured run, a prediction against
    # the first prediction for the same GPU
    baselines: dict[str | None, tuple[int, int]] = {}
    for i, r in enumerate(results, 1):
        if r.peak is not None:
            baselines.setdefault(r.predicted_for, (i, r.peak))
    rows = []
    for i, r in enumerate(results, 1):
        peak = r.peak
        base = baselines.get(r.predicted_for)
        change = None if peak is None or base is None or base[0] == i else peak - base[1]
        breakdown = r.report.breakdown if r.report else None
        acts = breakdown.highest.get(Category.ACTIVATION, 0) if breakdown else 0
        described = r.config.describe()
        if r.predicted_for:
            described += f" · predicted for {r.predicted_for}"
        rows.append(
            text_cell(str(i), CELL)
            + text_cell(described)
            + num_cell(peak)
            + (num_cell(change, signed=True, colour=True) if change is not None else text_cell(""))
            + num_cell(acts)
            + text_cell(
                fmt_seconds(r.report.seconds) if r.report and not r.predicted_for else "",
                CELL,
            )
            + text_cell(_verdict(r), f"{LEFT};color:{GROW}")
        )
    head = ["run", "configuration", "peak", "vs baseline", "activations", "time", ""]
    html = table(head, rows, "memlab-runs")
    if len(baselines) > 1 or None not in baselines:
        runs = ", ".join(
            f"run {i} ({'measured' if kind is None else f'predicted for {kind}'})"
            for kind, (i, _) in baselines.items()
        )
        html += f'<div style="font-size:11px;color:#555">baselines: {escape(runs)}</div>'
    return html


def _verdict(r: RunResult) -> str:
    if not r.oom:
        return ""
    return "predicted not to fit" if r.predicted_for else "out of memory"


def bars(results: list[RunResult]) -> Any:
    """Stacked bars: each run's bytes by category at its peak."""
    import matplotlib.pyplot  # noqa: F401  (registers inline display)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 2.8), layout="constrained")
    ax = fig.add_subplot()
    xs = list(range(1, len(results) + 1))
    bottom = [0.0] * len(results)
    for c in Category:
        values = [
            (r.report.breakdown.at_peak.get(c, 0) if r.report and r.report.breakdown else 0) / MiB
            for r in results
        ]
        if any(values):
            ax.bar(xs, values, bottom=bottom, color=_COLOURS[c], label=c.value.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("run")
    ax.set_ylabel("MiB at the peak")
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1, 1))
    return fig


def png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()
