"""The panel's predictions over several ranks, and the figure a run's fit is judged by.

A measured run with ``world_size`` > 1 comes back from `memlab.step.run` with its per-rank
figures (this process's step divided by the sharding's rule). A prediction for a GPU gets them
here from the estimate (`memlab.estimate.per_rank`), and fits when one rank does: its peak plus
the allocator overhead the single-process prediction had (reserved minus tensor bytes at the
peak: the cuBLAS workspace, rounding and the cache), since each rank's own cache is not modelled.
"""

from __future__ import annotations

import dataclasses

from memlab.estimate import Estimate, per_rank
from memlab.estimate.gpus import GPU
from memlab.reports.report import MemoryReport
from memlab.reports.units import fmt_bytes
from memlab.step import RunConfig, RunResult
from memlab.step.ranks import RULE


def overhead(report: MemoryReport) -> int:
    """A predicted step's allocator overhead: peak reserved less the tensors at the peak."""
    b, reserved = report.breakdown, report.peak_reserved
    if b is None or reserved is None:
        return 0
    return max(reserved - sum(b.at_peak.values()), 0)


def predicted(e: Estimate, config: RunConfig, card: GPU) -> RunResult:
    """The estimate as a panel run for ``card``: fits when its peak reserved does, or for
    several ranks, when one rank's peak and the overhead do."""
    budget = config.budget or card.usable
    if config.world_size == 1:
        fits = e.fits(budget)
        error = None
        if not fits:
            error = (
                f"predicted not to fit on {card.name}: {e.notes[0]}"
                if e.oom
                else f"predicted peak reserved {fmt_bytes(e.peak_reserved)} exceeds "
                f"{fmt_bytes(budget)}"
            )
        return RunResult(config, e.report, oom=not fits, error=error, predicted_for=card.name)
    strategy, reshard = RULE[config.sharding]
    ranks = per_rank(e, config.world_size, strategy, reshard_after_forward=reshard)
    extra, report = overhead(e.report), e.report
    if e.oom:  # the whole step on one card ran out: its allocator overhead is not known
        said = (
            f"the whole step would not fit on one {card.name}; one rank is judged by its tensors "
            "alone (the allocator overhead of a step that ran out is not known)"
        )
        report = dataclasses.replace(report, notes=(*report.notes, said))
        extra = 0
    held = ranks.total + extra
    error = None
    if held > budget:
        error = (
            f"predicted peak a rank {fmt_bytes(ranks.total)} and allocator overhead "
            f"{fmt_bytes(extra)} exceed {fmt_bytes(budget)}"
        )
    return RunResult(
        config,
        report,
        oom=held > budget,
        error=error,
        predicted_for=card.name,
        ranks=ranks,
    )


def fit_and_peak(result: RunResult) -> tuple[bool, int | None]:
    """Whether a step fitted, and the peak its fit was judged by: one rank's peak (and, for a
    prediction, the allocator overhead) over several ranks; peak reserved for a predicted step,
    peak allocated for a measured one. None after an out-of-memory error, real or predicted:
    the report stops where the memory ran out."""
    report, error = result.report, result.error or ""
    if report is None or (result.oom and not error.startswith(("the peak", "predicted peak"))):
        return not result.oom, None
    if result.ranks is not None:
        extra = overhead(report) if result.predicted_for else 0
        return not result.oom, result.ranks.total + extra
    return not result.oom, report.peak_reserved if result.predicted_for else report.peak_allocated
