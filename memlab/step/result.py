"""The result of one step: its configuration and report, or why it did not fit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memlab.reports.frame import heading, note, warning
from memlab.reports.oom import OOMExplanation
from memlab.reports.protocol import Result
from memlab.reports.report import MemoryReport
from memlab.reports.units import fmt_bytes
from memlab.step.config import RunConfig
from memlab.step.rank_view import run_html, run_lines
from memlab.step.ranks import RankMemory


@dataclass(frozen=True)
class RunResult(Result):
    """One what-if run: what was run, its report (None when it failed before one), and whether
    it ran out of memory or over its budget (``oom``, with ``error`` saying which)."""

    css = "memlab-run"

    config: RunConfig
    report: MemoryReport | None
    oom: bool = False
    error: str | None = None
    #: The retention experiment: memory allocated after each iteration, in bytes.
    series: tuple[int, ...] = ()
    #: Not measured but predicted by `memlab.estimate` for this GPU (its name).
    predicted_for: str | None = None
    #: An out-of-memory explained: the cache, what was live, the levers (with
    #: `StepHooks.on_oom`, e.g. the estimator's `run_levers`).
    explanation: OOMExplanation | None = None
    #: One rank's memory for ``config.world_size`` > 1: this process's step divided by the
    #: sharding's rule (`memlab.step.ranks`), not measured on that many ranks.
    ranks: RankMemory | None = None

    @property
    def rank_peak(self) -> int | None:
        """The peak of one rank: ``ranks.total`` when sharded, else the step's own peak."""
        return self.ranks.total if self.ranks is not None else self.peak

    @property
    def peak(self) -> int | None:
        return None if self.report is None else self.report.peak_allocated

    @property
    def verdict(self) -> str:
        """``""`` when the step fitted, else "out of memory" or "predicted not to fit"."""
        if not self.oom:
            return ""
        return "predicted not to fit" if self.predicted_for else "out of memory"

    @property
    def title(self) -> str:
        """ "what-if run · train, batch 4, adam" (" · predicted for T4" for a prediction)."""
        title = f"what-if run · {self.config.describe()}"
        return title + (f" · predicted for {self.predicted_for}" if self.predicted_for else "")

    def _series(self) -> str | None:
        if not self.series:
            return None
        return "allocated after each iteration: " + ", ".join(fmt_bytes(b) for b in self.series)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.describe(),
            "oom": self.oom,
            "error": self.error,
            "series": list(self.series),
            "predicted_for": self.predicted_for,
            "peak": self.peak,
            "report": None if self.report is None else self.report.to_dict(),
            "explanation": None if self.explanation is None else self.explanation.to_dict(),
            "ranks": None if self.ranks is None else self.ranks.to_dict(),
        }

    def text(self) -> str:
        lines = [self.title]
        if self.error or self.verdict:
            lines.append(f"  {': '.join(filter(None, (self.verdict, self.error)))}")
        series = self._series()
        if series:
            lines.append(f"  {series}")
        lines += run_lines(self)
        if self.report is not None:
            lines.append(self.report.text())
        if self.explanation is not None:
            lines.append(self.explanation.text())
        return "\n".join(lines)

    def html(self) -> str:
        parts = [heading(self.title)]
        if self.error or self.verdict:
            parts.append(warning(": ".join(filter(None, (self.verdict, self.error)))))
        series = self._series()
        if series:
            parts.append(note(series))
        parts += filter(None, [run_html(self)])
        if self.report is not None:
            parts.append(self.report.html())
        if self.explanation is not None:
            parts.append(self.explanation.html())
        return "\n".join(parts)
