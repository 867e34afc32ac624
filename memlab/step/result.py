"""The result of one step: its configuration and report, or why it did not fit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memlab.reports.report import MemoryReport
from memlab.step.config import RunConfig


@dataclass(frozen=True)
class RunResult:
    config: RunConfig
    report: MemoryReport | None
    oom: bool = False
    error: str | None = None
    #: The retention experiment: memory allocated after each iteration, in bytes.
    series: tuple[int, ...] = ()
    #: Not measured but predicted by `memlab.estimate` for this GPU (its name).
    predicted_for: str | None = None

    @property
    def peak(self) -> int | None:
        return None if self.report is None else self.report.peak_allocated

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.describe(),
            "oom": self.oom,
            "error": self.error,
            "series": list(self.series),
            "predicted_for": self.predicted_for,
            "report": None if self.report is None else self.report.to_dict(),
        }
