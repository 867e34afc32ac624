"""`check`: a strategy's per-rank prediction (`memlab.estimate.per_rank`) beside the ranks'
measured peaks (`RankTable`), with the error of each rank."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from memlab.core.categories import Category
from memlab.core.frames import users_traceback
from memlab.distributed.table import RankTable
from memlab.estimate.distributed import WORKSPACES, RankMemory
from memlab.reports.frame import CELL, NAME, heading, note, num_cell, table, text_cell
from memlab.reports.protocol import Result
from memlab.reports.units import fmt_bytes


@dataclass(frozen=True)
class Check(Result):
    """Measured peak per rank against the predicted one. ``error(r)``: (predicted - measured) /
    measured for rank ``r``."""

    css = "memlab-check"

    label: str
    predicted: RankMemory
    measured: RankTable

    def error(self, rank: int) -> float:
        peak = self.measured.rows[rank].peak
        return (self.predicted.total - peak) / peak if peak else float("inf")

    @property
    def worst(self) -> float:
        """The largest error of any rank, in absolute value."""
        return max(abs(self.error(r.rank)) for r in self.measured.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "predicted": self.predicted.to_dict(),
            "measured": [r.peak for r in self.measured.rows],
            "errors": [self.error(r.rank) for r in self.measured.rows],
        }

    def _title(self) -> str:
        p = self.predicted
        return f"{self.label}: {p.strategy} over {p.world_size}, predicted at the {p.moment}"

    def text(self) -> str:
        lines = [self._title()]
        for r in self.measured.rows:
            lines.append(
                f"  rank {r.rank}: measured {fmt_bytes(r.peak)} ({r.peak_phase}), predicted "
                f"{fmt_bytes(self.predicted.total)}, error {self.error(r.rank):+.1%}"
            )
        return "\n".join(lines)

    def html(self) -> str:
        rows = [
            text_cell(f"rank {r.rank}", NAME)
            + num_cell(r.peak)
            + text_cell(r.peak_phase)
            + num_cell(self.predicted.total)
            + text_cell(f"{self.error(r.rank):+.1%}", CELL)
            for r in self.measured.rows
        ]
        head = ["", "measured peak", "phase", "predicted", "error"]
        return "\n".join(
            [
                heading(self._title()),
                table(head, rows, "memlab-check-table"),
                *(note(n) for n in self.predicted.notes),
            ]
        )


@users_traceback()
def check(measured: RankTable, predicted: RankMemory, label: str = "") -> Check:
    """Sets a prediction beside the ranks' measured peaks; ``label`` names the model."""
    if not isinstance(measured, RankTable):
        raise TypeError(f"measured must be a RankTable (gather), got {type(measured).__name__}.")
    if not isinstance(predicted, RankMemory):
        raise TypeError(
            f"predicted must be a RankMemory (per_rank), got {type(predicted).__name__}."
        )
    if predicted.world_size != measured.world_size:
        raise ValueError(
            f"the prediction is for {predicted.world_size} ranks and the job had "
            f"{measured.world_size}: pass per_rank(estimate, {measured.world_size}, ...)."
        )
    return Check(label, _on_their_devices(predicted, measured), measured)


def _on_their_devices(predicted: RankMemory, measured: RankTable) -> RankMemory:
    """``predicted`` without the cuBLAS workspaces of a GPU estimate (`per_rank` counts them as
    unattributed) where the ranks measured ran on no GPU, which holds none."""
    said = [n for n in predicted.notes if n.startswith(WORKSPACES)]
    if not said or any(r.device.startswith("cuda") for r in measured.rows):
        return predicted
    held: dict[Category, int] = {
        c: b for c, b in predicted.by_category.items() if c is not Category.UNATTRIBUTED
    }
    notes = [n for n in predicted.notes if n not in said]
    notes.append("cuBLAS workspaces left out: the ranks ran without a GPU")
    return replace(predicted, by_category=held, notes=tuple(notes))
