"""What the panel draws: the table of runs and the chart of their peaks by category, both from
`memlab.step.comparison.Comparison`."""

from __future__ import annotations

import contextlib
import re
from typing import Any

from memlab.reports import plot
from memlab.reports.frame import CELL
from memlab.step.comparison import Comparison
from memlab.step.result import RunResult

#: A per-rank table's "ranks" cell ("4 × zero3"), whose spaces must not break.
RANKS = re.compile(r"(<td[^>]*>\d+) × ")
#: The panel's charts are small: fewer dots per inch than the magics' figures.
DPI = 80


def runs_table(results: list[RunResult]) -> str:
    """The runs compared, as HTML ("" before the first run). In the panel's narrow output the
    figures keep to one line each ("36.0 MiB", "2 × fsdp"): the configuration wraps instead."""
    if not results:
        return ""
    html = Comparison(results)._repr_html_().replace(CELL, f"{CELL};white-space:nowrap")
    return RANKS.sub("\\1\u00a0×\u00a0", html)  # "4 × zero3" on one line


def bars(results: list[RunResult]) -> Any:
    """Stacked bars: each run's bytes by category at its peak."""
    return Comparison(results).plot()


def png(fig: Any) -> bytes:
    return plot.png(fig, dpi=DPI)


def load_charts() -> None:
    """matplotlib loaded now (about a second, once a process) rather than at the first chart,
    inside a run or a search whose time the user reads as the work's. One that fails to load is
    said by the first chart, as before."""
    with contextlib.suppress(Exception):
        plot.figure_class()
