"""What the panel draws: the table of runs and the chart of their peaks by category, both from
`memlab.step.comparison.Comparison`."""

from __future__ import annotations

from typing import Any

from memlab.reports import plot
from memlab.step.comparison import Comparison
from memlab.step.result import RunResult

#: The panel's charts are small: fewer dots per inch than the magics' figures.
DPI = 80


def runs_table(results: list[RunResult]) -> str:
    """The runs compared, as HTML ("" before the first run)."""
    return Comparison(results)._repr_html_() if results else ""


def bars(results: list[RunResult]) -> Any:
    """Stacked bars: each run's bytes by category at its peak."""
    return Comparison(results).plot()


def png(fig: Any) -> bytes:
    return plot.png(fig, dpi=DPI)
