"""Per-rank figures as a run's report and `Comparison` show them: one rank's parameters,
gradients, optimizer state, activations, communication buffers, the rest and its peak, and
where the figures come from (measured in this process, or derived by the per-rank rule)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memlab.core.categories import Category
from memlab.reports.frame import CELL, LEFT, heading, note, num_cell, table, text_cell
from memlab.reports.text import columns
from memlab.reports.units import fmt_bytes
from memlab.step.ranks import STEP

if TYPE_CHECKING:
    from memlab.step.result import RunResult

#: The categories shown in a column of their own; the rest (inputs, temporaries, buffers, ...)
#: is one column, so that a row adds up to its peak.
SHOWN = (
    (Category.PARAMETER, "parameters"),
    (Category.GRADIENT, "gradients"),
    (Category.OPTIMIZER_STATE, "optimizer state"),
    (Category.ACTIVATION, "activations"),
    (Category.COMMUNICATION, "communication"),
)
HEAD = ["run", "ranks", *(name for _, name in SHOWN), "the rest", "peak a rank", "figures"]
#: What a derived row means, said under the table.
DERIVED = (
    "derived: the step measured (or predicted) in this one process, divided among the ranks by "
    "the strategy's rule (memlab.step.ranks, as memlab.estimate.per_rank); not measured on N "
    "ranks (memlab.distributed.launch measures a real job). Not counted: the communication "
    "library's own buffers and each rank's allocator cache"
)


@dataclass(frozen=True)
class RankRow:
    """One run's figures for one rank; ``cells`` follow `SHOWN`, then the rest."""

    run: int
    ranks: str
    cells: tuple[int, ...]
    peak: int
    #: "measured", "predicted for T4", "derived from the measured step", ...
    source: str
    moment: str | None

    def to_dict(self) -> dict[str, Any]:
        names = [name for _, name in SHOWN] + ["the rest"]
        return {
            "run": self.run,
            "ranks": self.ranks,
            **dict(zip(names, self.cells, strict=True)),
            "peak": self.peak,
            "source": self.source,
            "moment": self.moment,
        }


def when(moment: str | None) -> str:
    """ "during the optimizer step", "during forward and backward"."""
    return f"during {'the ' if moment == STEP else ''}{moment}"


def held(r: RunResult) -> dict[Category, int]:
    """One rank's bytes by category at its peak, the strategy's buffers counted as
    communication ({} for one rank)."""
    if r.ranks is None:
        return {}
    by = dict(r.ranks.by_category)
    by[Category.COMMUNICATION] = by.get(Category.COMMUNICATION, 0) + r.ranks.extra
    return by


def row_of(i: int, r: RunResult) -> RankRow | None:
    """Run ``i``'s row: its per-rank figures, or its own peak for one rank (None without a
    breakdown)."""
    breakdown = r.report.breakdown if r.report else None
    kind = f"predicted for {r.predicted_for}" if r.predicted_for else "measured"
    if r.ranks is not None:
        m, by = r.ranks, held(r)
        made = f"the prediction for {r.predicted_for}" if r.predicted_for else "the measured step"
        peak, source, moment = m.total, f"derived from {made}", m.moment
        ranks = f"{m.world_size} × {r.config.sharding}"
    elif breakdown is not None and r.peak is not None:
        by, peak, source, moment = dict(breakdown.at_peak), r.peak, kind, None
        ranks = "1"
    else:
        return None
    cells = [by.get(c, 0) for c, _ in SHOWN]
    return RankRow(i, ranks, (*cells, max(peak - sum(cells), 0)), peak, source, moment)


def rows(results: Sequence[RunResult]) -> list[RankRow]:
    found = (row_of(i, r) for i, r in enumerate(results, 1))
    return [row for row in found if row is not None]


def sharded(results: Sequence[RunResult]) -> bool:
    """Whether any run has more than one rank (the per-rank table is shown then)."""
    return any(r.ranks is not None for r in results)


def run_lines(r: RunResult) -> list[str]:
    """A run's per-rank section, as text (none for one rank)."""
    row = row_of(1, r)
    if row is None or r.ranks is None:
        return []
    names = [name for _, name in SHOWN] + ["the rest"]
    figures = ", ".join(f"{n} {fmt_bytes(b)}" for n, b in zip(names, row.cells, strict=True))
    return [
        f"  per rank ({row.ranks}, {row.source}): peak {fmt_bytes(row.peak)} {when(row.moment)}",
        f"    {figures}",
        *(f"    note: {n}" for n in (*r.ranks.notes, DERIVED)),
    ]


def run_html(r: RunResult) -> str:
    """A run's per-rank section, as HTML ("" for one rank)."""
    if r.ranks is None:
        return ""
    return table_html([r], numbered=False)


def table_lines(results: Sequence[RunResult]) -> list[str]:
    """The per-rank table of `Comparison`, as text."""
    body = [
        [
            str(row.run),
            row.ranks,
            *(fmt_bytes(b) for b in row.cells),
            fmt_bytes(row.peak),
            row.source,
        ]
        for row in rows(results)
    ]
    notes = sorted({n for r in results if r.ranks for n in r.ranks.notes})
    return [
        "per rank",
        *columns(HEAD, body, align="rl" + "r" * (len(SHOWN) + 2) + "l"),
        *(f"  {n}" for n in (*notes, DERIVED)),
    ]


def table_html(results: Sequence[RunResult], numbered: bool = True) -> str:
    """The per-rank table, as HTML (a run's own section when not ``numbered``)."""
    found = rows(results)
    head = HEAD if numbered else HEAD[1:]
    cells = [
        (text_cell(str(row.run), CELL) if numbered else "")
        + text_cell(row.ranks, LEFT)
        + "".join(num_cell(b) for b in row.cells)
        + num_cell(row.peak)
        + text_cell(row.source, LEFT)
        for row in found
    ]
    notes = sorted({n for r in results if r.ranks for n in r.ranks.notes})
    moments = [f"run {row.run}: peak {when(row.moment)}" for row in found if row.moment]
    said = (*notes, *([] if not numbered else moments), DERIVED)
    if not numbered and found and found[0].moment:
        said = (f"peak {when(found[0].moment)}", *said)
    return "\n".join(
        [
            heading("per rank"),
            table(head, cells, "memlab-ranks"),
            *(note(n) for n in said),
        ]
    )
