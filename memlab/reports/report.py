"""Report objects: the numbers of one measured region, immutable, able to render themselves."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from memlab.core.categories import Category
from memlab.core.choices import PeakScope, Source
from memlab.core.cuda import DriverView
from memlab.core.frames import users_traceback
from memlab.reports.host import HostMemory
from memlab.reports.protocol import Result
from memlab.reports.timeline import Timeline as Timeline
from memlab.reports.units import fmt_label

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from memlab.snapshot.interactive import Chart

#: What ``peak_scope`` means.
PEAK_SCOPES = {
    PeakScope.REGION: "the highest value inside the region",
    PeakScope.SINCE_RESET: "the highest value since the allocator's peak counter was last reset "
    "(--no-reset: memlab left it alone), so it may predate the region",
}


@dataclass(frozen=True)
class Breakdown:
    """Bytes per category at the region's peak, at its end, and the highest each category
    reached at any moment (activations peak at the end of a forward, which is often not when the
    whole step peaks)."""

    at_peak: Mapping[Category, int]
    at_end: Mapping[Category, int]
    highest: Mapping[Category, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("at_peak", "at_end", "highest"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def __reduce__(self) -> tuple[Any, ...]:
        # (a mapping proxy cannot be pickled or deep-copied: made again from plain dicts)
        return (type(self), (dict(self.at_peak), dict(self.at_end), dict(self.highest)))

    def __hash__(self) -> int:  # (a mapping proxy has no hash; its items have: equal, equal)
        return hash(tuple(frozenset(m.items()) for m in (self.at_peak, self.at_end, self.highest)))

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {
            name: {c.value: int(getattr(self, name).get(c, 0)) for c in Category}
            for name in ("at_peak", "at_end", "highest")
        }


@dataclass(frozen=True)
class MemoryReport(Result):
    """What one region did to one device's memory.

    ``source`` says where the numbers come from: ``"cuda-allocator"`` (the caching allocator's
    own counters), ``"estimate"`` (a prediction by `memlab.estimate`, not a measurement),
    ``"tensor-accounting"`` (bytes of the tensor storages memlab saw; on a CPU,
    "allocated" means the live storages memlab knows about) or ``"cpu-allocator"`` (the CPU
    allocator's own record of the region, which sees inside compiled code: a compiled step).
    """

    css = "memlab-report"

    device: str
    source: Source
    allocated_before: int
    allocated_after: int
    peak_allocated: int
    seconds: float
    label: str | None = None
    reserved_before: int | None = None
    reserved_after: int | None = None
    peak_reserved: int | None = None
    active_before: int | None = None
    active_after: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    peak_scope: PeakScope = PeakScope.REGION
    breakdown: Breakdown | None = None
    timeline: Timeline | None = None
    driver: DriverView | None = None
    raised: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: What an offload lever kept in host memory (CPU RAM), beside the device's figures.
    host: HostMemory | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", Source.parse("source", self.source))
        object.__setattr__(self, "peak_scope", PeakScope.parse("peak_scope", self.peak_scope))

    def made_later(
        self, make: Callable[[], tuple[Breakdown | None, tuple[str, ...]]]
    ) -> MemoryReport:
        """This report, its ``breakdown`` and ``notes`` now made by ``make()`` when first read
        (a breakdown replayed from the CUDA allocator's log: `memlab.core.cuda_later`). Only
        for a report just made, before anyone has it."""
        object.__delattr__(self, "breakdown")
        object.__delattr__(self, "notes")
        object.__setattr__(self, "_make", make)
        return self

    def _made(self, name: str) -> Any:
        found = self.__dict__
        make = found.get("_make")
        if make is not None and name not in found:
            breakdown, notes = make()  # (the same each call: two threads take the one made)
            object.__setattr__(self, "breakdown", breakdown)
            object.__setattr__(self, "notes", notes)
            found.pop("_make", None)
        if name not in found:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return found[name]

    def __getstate__(self) -> dict[str, Any]:
        # (pickled and copied made: the maker is a closure)
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def allocated_delta(self) -> int:
        return self.allocated_after - self.allocated_before

    @property
    def peak_delta(self) -> int:
        """Peak minus before: how far the region climbed above where it started."""
        return self.peak_allocated - self.allocated_before

    def to_dict(self) -> dict[str, Any]:
        """Plain data: every memory figure is an int in bytes."""
        d: dict[str, Any] = {
            "device": self.device,
            "source": str(self.source),
            "label": self.label,
            "allocated_before": self.allocated_before,
            "allocated_after": self.allocated_after,
            "allocated_delta": self.allocated_delta,
            "peak_allocated": self.peak_allocated,
            "peak_delta": self.peak_delta,
            "peak_scope": str(self.peak_scope),
            "reserved_before": self.reserved_before,
            "reserved_after": self.reserved_after,
            "peak_reserved": self.peak_reserved,
            "active_before": self.active_before,
            "active_after": self.active_after,
            "alloc_retries": self.alloc_retries,
            "ooms": self.ooms,
            "seconds": self.seconds,
            "raised": self.raised,
            "notes": list(self.notes),
        }
        if self.breakdown is not None:
            d["categories"] = self.breakdown.to_dict()
        if self.timeline is not None:
            d["timeline"] = self.timeline.to_dict()
        if self.host is not None:
            d["host"] = self.host.to_dict()
        if self.driver is not None:
            d["driver"] = {
                "free": self.driver.free,
                "total": self.driver.total,
                "process_used": self.driver.process_used,
            }
        return d

    def text(self) -> str:
        from memlab.reports.text import render_text

        return render_text(self)

    def html(self) -> str:
        from memlab.reports.html import render_html

        return render_html(self)

    @users_traceback()  # (an ax refused: said without memlab's frames)
    def plot(self, ax: Axes | None = None) -> Figure:
        """The timeline as a matplotlib figure (needs ``timeline=True`` when measuring)."""
        from memlab.reports.plot import plot_timeline

        return plot_timeline(self, ax)

    @users_traceback()  # (a path refused: said without memlab's frames)
    def to_snapshot(self, path: str | os.PathLike[str]) -> Path:
        """Write the timeline as a PyTorch memory snapshot (a pickle that torch's viewer,
        https://pytorch.org/memory_viz, and `memlab.load_snapshot` open). Needs a timeline
        (``timeline=True``); allocations are made up to add up to it exactly."""
        from memlab.snapshot.write import write_timeline

        tl = self._timeline_or_raise("to_snapshot")
        origin = (self.device, self.source.value)  # (read back as this device, not cuda:0)
        return write_timeline(
            path, self.allocated_before, tl.seconds, tl.allocated, tl.phases, origin
        )

    def chart(self) -> Chart:
        """The timeline as an interactive chart (zoom, pan, hover; works offline)."""
        from memlab.snapshot.collect import parse
        from memlab.snapshot.interactive import chart_of_trace
        from memlab.snapshot.write import snapshot_dict, timeline_events

        tl = self._timeline_or_raise("chart")
        events = timeline_events(self.allocated_before, tl.seconds, tl.allocated, tl.phases)
        _, trace = parse(snapshot_dict(*events))
        title = f"{self.device}{' · ' + fmt_label(self.label) if self.label else ''} ({tl.source})"
        return chart_of_trace(trace, title)

    def _timeline_or_raise(self, what: str) -> Timeline:
        if self.timeline is None or not len(self.timeline):
            raise ValueError(
                f"{what}() needs a timeline and this report has none: measure with "
                "timeline=True (%%gpumem --timeline, or memlab.track(timeline=True))."
            )
        return self.timeline


class _MadeLater:
    """A report's field that `MemoryReport.made_later` leaves to be made when first read. A
    descriptor without ``__set__``: the value a report holds is found before it, so it is only
    asked where the report has none yet."""

    def __init__(self, name: str, default: Any) -> None:
        self.name, self.default = name, default

    def __get__(self, report: MemoryReport | None, owner: Any = None) -> Any:
        return self.default if report is None else report._made(self.name)


# (set after the class is made: the dataclass keeps its own defaults for __init__)
MemoryReport.breakdown = _MadeLater("breakdown", None)  # type: ignore[assignment]
MemoryReport.notes = _MadeLater("notes", ())  # type: ignore[assignment]


@dataclass(frozen=True)
class Reports(Result):
    """The reports of one region measured on several devices (``device="all"``): each report in
    its own frame, one under the other."""

    css = "memlab-devices"

    reports: tuple[MemoryReport, ...]

    def __iter__(self) -> Iterator[MemoryReport]:
        return iter(self.reports)

    def __len__(self) -> int:
        return len(self.reports)

    def __getitem__(self, i: int) -> MemoryReport:
        return self.reports[i]

    def noted(self, note: str) -> Reports:
        """These reports, ``note`` added to each one's notes."""
        return Reports(tuple(replace(r, notes=(*r.notes, note)) for r in self.reports))

    def to_dict(self) -> dict[str, Any]:
        return {"reports": [r.to_dict() for r in self.reports]}

    def text(self) -> str:
        return "\n\n".join(r.text() for r in self.reports)

    def html(self) -> str:
        return "\n".join(r._repr_html_() for r in self.reports)
