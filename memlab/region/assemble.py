"""Assembling a region's report from what was measured: the allocator's counters and the
tensor accounting's tally (categories, timeline)."""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memlab.core.categories import Category
from memlab.core.choices import PeakScope, TimelineSource
from memlab.core.cuda import CudaRegion, driver_view
from memlab.core.devices import Target
from memlab.core.recorder import Phase, Tally
from memlab.reports.report import Breakdown, MemoryReport, Timeline

#: A timeline keeps at most about this many points (the extremes of each stretch survive).
MAX_TIMELINE_POINTS = 4000


def assemble(
    target: Target,
    tally: Tally | None,
    cr: CudaRegion | None,
    *,
    seconds: float,
    label: str | None,
    raised: type[BaseException] | None,
    notes: list[str],
    timeline: bool,
    driver: bool,
) -> MemoryReport:
    """One device's report: the allocator's counters on CUDA (``cr``), tensor accounting
    (``tally``) elsewhere and for the breakdown and timeline."""
    common: dict[str, Any] = {
        "device": target.name,
        "source": target.source,
        "seconds": seconds,
        "label": label,
        "raised": raised.__name__ if raised is not None else None,
    }
    if cr is None:
        assert tally is not None
        if driver:  # asked for, and never silently dropped
            notes.append(
                f"driver view: none for {target.name} (it is a CUDA device's: mem_get_info, NVML)"
            )
        return MemoryReport(
            allocated_before=tally.before,
            allocated_after=tally.after,
            peak_allocated=tally.peak,
            breakdown=_breakdown(tally, None, None),
            timeline=_timeline(tally, 0),
            notes=tuple(notes),
            **common,
        )
    s, e = cr.start, cr.end
    if driver and not torch.cuda.is_initialized():
        notes.append("driver view: none (nothing in this process has initialised CUDA yet)")
    if tally is not None and timeline:
        notes.append(
            "timeline: tensor bytes from accounting, offset to the allocator's figure at the "
            "start (the allocator's block rounding and workspaces are not in it)"
        )
    report = MemoryReport(
        allocated_before=s.allocated,
        allocated_after=e.allocated,
        peak_allocated=cr.peak_allocated,
        reserved_before=s.reserved,
        reserved_after=e.reserved,
        peak_reserved=cr.peak_reserved,
        active_before=s.active,
        active_after=e.active,
        alloc_retries=e.alloc_retries - s.alloc_retries,
        ooms=e.ooms - s.ooms,
        peak_scope=PeakScope.REGION if cr.peak_is_regional else PeakScope.SINCE_RESET,
        breakdown=_breakdown(tally, cr.peak_allocated, e.allocated) if tally else None,
        timeline=_timeline(tally, s.allocated - tally.before) if tally else None,
        driver=driver_view(cr.index) if driver and torch.cuda.is_initialized() else None,
        notes=tuple(notes),
        **common,
    )
    if tally is not None and tally.later is not None:  # the log's replay, when first read
        report.made_later(_later(tally.later, cr.peak_allocated, e.allocated, report.notes))
    return report


def _later(
    make: Callable[[], tuple[Tally | None, tuple[str, ...]]],
    peak: int,
    end: int,
    notes: tuple[str, ...],
) -> Callable[[], tuple[Breakdown | None, tuple[str, ...]]]:
    lock = threading.Lock()
    done: list[tuple[Breakdown | None, tuple[str, ...]]] = []

    def made() -> tuple[Breakdown | None, tuple[str, ...]]:
        with lock:  # (one Breakdown for every thread that reads it)
            if not done:
                tally, said = make()
                b = _breakdown(tally, peak, end) if tally is not None else None
                done.append((b, (*notes, *said)))
            return done[0]

    return made


def _breakdown(tally: Tally, peak: int | None, end: int | None) -> Breakdown | None:
    """Categories from the tally; on CUDA, what the allocator holds beyond them is unattributed."""
    if tally.at_peak is None or tally.at_end is None or tally.highest is None:
        return None
    at_peak, at_end = dict(tally.at_peak), dict(tally.at_end)
    if peak is not None and end is not None:
        at_peak[Category.UNATTRIBUTED] = peak - sum(at_peak.values())
        at_end[Category.UNATTRIBUTED] = end - sum(at_end.values())
    return Breakdown(at_peak, at_end, tally.highest)


def thin(values: Sequence[int], limit: int = MAX_TIMELINE_POINTS) -> list[int]:
    """Indices of at most about ``limit`` of ``values`` that keep their shape: the lowest and
    the highest point of each stretch, in order. The maximum (the peak) is always kept."""
    n = len(values)
    if n <= limit:
        return list(range(n))
    step = n / (limit // 2)
    keep: list[int] = []
    for b in range(limit // 2):
        lo, hi = int(b * step), min(n, int((b + 1) * step))
        if lo >= hi:
            continue
        span = range(lo, hi)
        i_min = min(span, key=values.__getitem__)
        i_max = max(span, key=values.__getitem__)
        keep.extend(sorted({i_min, i_max}))
    return keep


def _timeline(tally: Tally, offset: int) -> Timeline | None:
    """The tally's timeline, offset by ``offset`` bytes, thinned now (what it keeps is small);
    its tuples are made when first read."""
    times, totals, phases = tally.times, tally.totals, tally.phases
    if times is None or totals is None or phases is None:
        return None
    if len(totals) > MAX_TIMELINE_POINTS:
        keep = thin(totals)
        times = array("d", [times[i] for i in keep])
        totals = array("q", [totals[i] for i in keep])
        phases = array("b", [phases[i] for i in keep])
    return Timeline.deferred(
        lambda: _points(times, totals, phases, offset),
        len(totals),
        TimelineSource.TENSOR_ACCOUNTING,
    )


def _points(
    times: Sequence[float], totals: Sequence[int], phases: Sequence[int], offset: int
) -> tuple[tuple[float, ...], tuple[int, ...], tuple[str, ...]]:
    shifted = totals if not offset else (v + offset for v in totals)
    return tuple(times), tuple(shifted), tuple(map(Phase.NAMES.__getitem__, phases))
