"""Runs side by side: each run's peak against its baseline, its activations, time and verdict.

Like is compared with like: a measured run with the first measured run, a prediction with the
first prediction for the same GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memlab.core.categories import Category
from memlab.core.frames import users_traceback
from memlab.reports.frame import CELL, GROW, LEFT, heading, note, num_cell, table, text_cell
from memlab.reports.protocol import Result
from memlab.reports.text import columns
from memlab.reports.units import fmt_bytes, fmt_seconds
from memlab.step.rank_view import held, sharded, table_html, table_lines
from memlab.step.rank_view import rows as rank_rows
from memlab.step.result import RunResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

EMPTY = "memlab: no runs yet."
HEAD = ["run", "configuration", "peak", "before the step", "vs baseline", "activations", "time", ""]
#: What the "before the step" column means, said under the table.
BEFORE = (
    "before the step: what was allocated when the measured step began: the model's weights, "
    "the optimizer state of the warm-up step, and anything else alive (your own tensors and "
    "outputs from earlier cells, other models); the peak includes it"
)
#: Said under the table when a run is compiled.
COMPILED = (
    "activations n/a: a compiled step (torch.compile) is measured by the allocator, which does "
    "not say what a block is for; its peak and end are exact"
)


@dataclass(frozen=True)
class Row:
    """One run's line of the comparison (``run`` counts from 1)."""

    run: int
    configuration: str
    peak: int | None
    #: Allocated when the step began (the user's own tensors, earlier outputs, other models).
    before: int | None
    #: Peak minus its baseline's peak; None on a baseline row or without a peak.
    vs_baseline: int | None
    #: The most activation bytes alive at any moment of the step; None for a compiled step,
    #: whose categories are not known inside compiled code.
    activations: int | None
    #: None for a prediction (its run time is the meta device's, not a GPU's) or a failed run.
    seconds: float | None
    verdict: str


@dataclass(frozen=True)
class Comparison(Result):
    """Several runs (`RunResult`) side by side: the what-if panel's table and chart."""

    css = "memlab-comparison"

    results: tuple[RunResult, ...]

    def __init__(self, results: Sequence[RunResult]) -> None:
        object.__setattr__(self, "results", tuple(results))

    @property
    def title(self) -> str:
        n = len(self.results)
        return f"memlab: {n} run{'s' if n != 1 else ''} compared"

    @property
    def baselines(self) -> dict[str | None, int]:
        """The run each kind is compared with: None (measured) or a GPU's name -> run number."""
        out: dict[str | None, int] = {}
        for i, r in enumerate(self.results, 1):
            if r.peak is not None:
                out.setdefault(r.predicted_for, i)
        return out

    def rows(self) -> list[Row]:
        base = {kind: (i, self.results[i - 1].peak) for kind, i in self.baselines.items()}
        rows = []
        for i, r in enumerate(self.results, 1):
            b = base.get(r.predicted_for)
            change = None
            if r.peak is not None and b is not None and b[1] is not None and b[0] != i:
                change = r.peak - b[1]
            breakdown = r.report.breakdown if r.report else None
            described = r.config.describe()
            if r.predicted_for:
                described += f" · predicted for {r.predicted_for}"
            rows.append(
                Row(
                    i,
                    described,
                    r.peak,
                    r.report.allocated_before if r.report else None,
                    change,
                    None if _compiled(r) else _activations(breakdown),
                    r.report.seconds if r.report and not r.predicted_for else None,
                    r.verdict,
                )
            )
        return rows

    def activation_note(self) -> str | None:
        """Why a prediction's activations differ from a measurement of the same step."""
        measured = {r.config.describe(): r for r in self.results if r.predicted_for is None}
        for r in self.results:
            same = measured.get(r.config.describe())
            if r.predicted_for is None or same is None or not (r.report and same.report):
                continue
            a, b = r.report.breakdown, same.report.breakdown
            if a is None or b is None:
                continue
            mine, theirs = (x.highest.get(Category.ACTIVATION, 0) for x in (a, b))
            if abs(mine - theirs) > 0.01 * max(mine, theirs, 1):
                step = r.config.describe()
                return (
                    f"activations differ between the measured and the predicted {step}"
                    f" ({fmt_bytes(theirs)} here, {fmt_bytes(mine)} predicted): a GPU runs "
                    "attention through fused kernels that keep no attention matrix, dropout with a "
                    "one-byte mask, and AMP in 16 bits where this device may not"
                )
        return None

    def notes(self) -> list[str]:
        compiled = any(_compiled(r) for r in self.results)
        said = [BEFORE, self.baseline_note(), self.activation_note(), COMPILED if compiled else ""]
        return [n for n in said if n]

    def baseline_note(self) -> str | None:
        """ "baselines: run 1 (measured), run 2 (predicted for T4)": said when it is not simply
        run 1 of measured runs."""
        kinds = self.baselines
        if len(kinds) <= 1 and None in kinds:
            return None
        return "baselines: " + ", ".join(
            f"run {i} ({'measured' if kind is None else f'predicted for {kind}'})"
            for kind, i in kinds.items()
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "runs": [
                {
                    **r.to_dict(),
                    "run": row.run,
                    "before": row.before,
                    "vs_baseline": row.vs_baseline,
                    "activations": row.activations,
                }
                for r, row in zip(self.results, self.rows(), strict=True)
            ],
            "baselines": [{"run": i, "predicted_for": k} for k, i in self.baselines.items()],
            "per_rank": [row.to_dict() for row in rank_rows(self.results)],
        }

    def text(self) -> str:
        if not self.results:
            return EMPTY
        rows = [
            [
                str(row.run),
                row.configuration,
                fmt_bytes(row.peak),
                fmt_bytes(row.before),
                "" if row.vs_baseline is None else fmt_bytes(row.vs_baseline, signed=True),
                fmt_bytes(row.activations),
                "" if row.seconds is None else fmt_seconds(row.seconds),
                row.verdict,
            ]
            for row in self.rows()
        ]
        lines = [self.title, *columns(HEAD, rows, align="rlrrrrrl")]
        lines += [f"  {n}" for n in self.notes()]
        if sharded(self.results):  # a run over several ranks: one rank's figures
            lines += table_lines(self.results)
        return "\n".join(lines)

    def html(self) -> str:
        if not self.results:
            return heading(EMPTY)
        cells = [
            text_cell(str(row.run), CELL)
            + text_cell(row.configuration)
            + num_cell(row.peak)
            + num_cell(row.before)
            + (
                num_cell(row.vs_baseline, signed=True, colour=True)
                if row.vs_baseline is not None
                else text_cell("")
            )
            + num_cell(row.activations)
            + text_cell("" if row.seconds is None else fmt_seconds(row.seconds), CELL)
            + text_cell(row.verdict, f"{LEFT};color:{GROW}")
            for row in self.rows()
        ]
        return (
            heading(self.title)
            + table(HEAD, cells, "memlab-runs")
            + "".join(f"\n{note(n)}" for n in self.notes())
            + (f"\n{table_html(self.results)}" if sharded(self.results) else "")
        )

    @users_traceback()  # (an ax refused: said without memlab's frames)
    def plot(self, ax: Axes | None = None) -> Figure:
        """Stacked bars: each run's bytes by category at its peak, numbered as in the table; a
        run over several ranks draws one rank's (the figure its budget judges)."""
        from memlab.reports.plot import plot_categories

        budgets = [r.config.budget for r in self.results if r.config.budget]
        return plot_categories(
            [held(r) or _at_peak(r) for r in self.results],
            ax,
            budget=budgets[-1] if budgets else None,
        )


def _compiled(r: RunResult) -> bool:
    """A measured compiled step: no categories inside compiled code (a prediction of one is
    the eager step's, with its categories)."""
    return bool(r.config.compile) and r.predicted_for is None


def _activations(breakdown: Any) -> int:
    return breakdown.highest.get(Category.ACTIVATION, 0) if breakdown else 0


def _at_peak(r: RunResult) -> dict[Category, int]:
    return dict(r.report.breakdown.at_peak) if r.report and r.report.breakdown else {}
