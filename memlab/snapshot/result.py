"""`Snapshot`: a PyTorch memory snapshot read into memlab's report: peak, timeline, the biggest
allocations with the line that made each, the live blocks and how fragmented the cache is."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from memlab.core.choices import Source, TimelineSource
from memlab.core.frames import users_traceback
from memlab.reports.frame import heading, note, num_cell, table, text_cell
from memlab.reports.protocol import Result
from memlab.reports.report import MemoryReport, Timeline
from memlab.reports.text import columns
from memlab.reports.units import fmt_bytes, fmt_seconds
from memlab.snapshot.trace import GROUPS, Trace, reduce

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from memlab.snapshot.interactive import Chart

#: Rows in each table of the report.
TOP = 10
NO_STACK = "no stack recorded"
#: Points a `Timeline` keeps (the extremes of each stretch survive).
TIMELINE_POINTS = 4_000


@dataclass(frozen=True)
class Allocation:
    """One allocation: its bytes, the user's line that made it, when it lived (seconds since the
    trace began; ``freed`` is ``None`` if it was live at the end)."""

    size: int
    line: str
    made: float | None = None
    freed: float | None = None
    group: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "line": self.line,
            "made": self.made,
            "freed": self.freed,
            "group": self.group,
        }


@dataclass(frozen=True)
class Snapshot(Result):
    """A snapshot written by ``torch.cuda.memory._dump_snapshot``, as a memlab report.

    Figures from the trace (``peak``, ``timeline``, ``top``) cover the recorded events; figures
    from the segments (``allocated``, ``reserved``, the free cache, ``live``) are the state when
    the snapshot was taken.
    """

    css = "memlab-snapshot"

    path: str
    device: int
    events: int
    allocated: int
    reserved: int
    segments: int
    free_cache: int
    largest_free: int
    internal_free: int
    live: tuple[Allocation, ...]
    top: tuple[Allocation, ...]
    trace: Trace = field(repr=False, compare=False)
    notes: tuple[str, ...] = ()
    #: Where memlab wrote the file from a report: that report's device and source (`origin_of`).
    origin: tuple[str, Source] | None = None

    @property
    def where(self) -> str:
        """The device the figures are of: ``cuda:N``, or the device of the memlab report the file
        was written from (``cpu``: a snapshot holds no device of its own but a GPU's number)."""
        return self.origin[0] if self.origin is not None else f"cuda:{self.device}"

    @property
    def before(self) -> int:
        """Bytes live before the first recorded event."""
        return self.trace.before

    @property
    def peak(self) -> int:
        """The highest allocated total over the trace (bytes)."""
        return self.trace.peak

    @property
    def fragmentation(self) -> float:
        """How scattered the free cache is: 0 when it is one block, near 1 when the largest free
        block is a sliver of it (1 - largest free block / free cache)."""
        return 1.0 - self.largest_free / self.free_cache if self.free_cache else 0.0

    @property
    def timeline(self) -> Timeline:
        """The allocated total over the trace, at most `TIMELINE_POINTS` points (peak kept)."""
        t = self.trace
        keep = reduce(t.totals, TIMELINE_POINTS)
        return Timeline(
            seconds=tuple(float(x) for x in t.times[keep]),
            allocated=tuple(int(x) for x in t.totals[keep]),
            phases=tuple(GROUPS[int(g)] for g in t.groups[keep]),
            source=TimelineSource.SNAPSHOT,
        )

    @property
    def report(self) -> MemoryReport:
        """The trace as a `MemoryReport`: before, after, peak, reserved and the timeline."""
        t = self.trace
        return MemoryReport(
            device=self.where,
            source=self.origin[1] if self.origin is not None else Source.CUDA_ALLOCATOR,
            allocated_before=t.before,
            allocated_after=int(t.totals[-1]) if len(t.totals) else t.before,
            peak_allocated=self.peak,
            seconds=float(t.times[-1]) if len(t.times) else 0.0,
            label=self.path,
            reserved_after=self.reserved,
            timeline=self.timeline,
            notes=self.notes,
        )

    def plot(self, ax: Any = None) -> Figure:
        """The timeline as a matplotlib figure."""
        return self.report.plot(ax)

    def chart(self) -> Chart:
        """The interactive timeline (zoom, pan, hover an allocation); works offline."""
        from memlab.snapshot.interactive import chart_of_trace

        return chart_of_trace(self.trace, f"{self.path} · {self.where}")

    @users_traceback()
    def to_snapshot(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace back as a snapshot (memlab's reading of it, frames cut to one)."""
        from memlab.snapshot.write import write_trace

        origin = None if self.origin is None else (self.origin[0], self.origin[1].value)
        return write_trace(self.trace, path, origin)

    def _figures(self) -> list[tuple[str, int]]:
        return [
            ("before the trace", self.before),
            ("peak allocated", self.peak),
            ("allocated at the end", self.allocated),
            ("reserved at the end", self.reserved),
            ("free in the cache", self.free_cache),
            ("largest free block", self.largest_free),
            ("rounding inside blocks", self.internal_free),
        ]

    def _title(self) -> tuple[str, str]:
        span = fmt_seconds(float(self.trace.times[-1])) if len(self.trace.times) else "0 s"
        if not len(self.trace.times):
            span = "no allocations"
        elif not self.trace.timed:
            span = f"{len(self.trace.times)} events (no times recorded)"
        sub = (
            f"{self.where}, {self.events:,} events over {span}, {self.segments} segments, "
            f"fragmentation {self.fragmentation:.0%}"
        )
        return f"memory snapshot {self.path}", sub

    def text(self) -> str:
        title, sub = self._title()
        lines = [f"{title}  [{sub}]"]
        lines += columns(("", "bytes"), [(n, fmt_bytes(v)) for n, v in self._figures()])
        for name, rows in (("largest allocations", self.top), ("live at the end", self.live)):
            lines.append(f"  {name}:")
            lines += columns(
                ("size", "made by"),
                [(fmt_bytes(a.size), a.line or NO_STACK) for a in rows],
                "rl",
                4,
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def html(self) -> str:
        title, sub = self._title()
        parts = [heading(title, sub)]
        rows = [f"{text_cell(n)}{num_cell(v)}" for n, v in self._figures()]
        parts.append(table(["", "bytes"], rows, "memlab-snapshot-figures"))
        for name, allocs in (("largest allocations", self.top), ("live at the end", self.live)):
            rows = [f"{num_cell(a.size)}{text_cell(a.line or NO_STACK)}" for a in allocs]
            parts.append(table(["size", f"made by ({name})"], rows, "memlab-snapshot-allocations"))
        parts += [note(n) for n in self.notes]
        return "\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "device": self.device,
            "where": self.where,
            "events": self.events,
            "before": self.before,
            "peak": self.peak,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "segments": self.segments,
            "free_cache": self.free_cache,
            "largest_free": self.largest_free,
            "internal_free": self.internal_free,
            "fragmentation": self.fragmentation,
            "top": [a.to_dict() for a in self.top],
            "live": [a.to_dict() for a in self.live],
            "timeline": self.timeline.to_dict(),
            "notes": list(self.notes),
        }


def origin_of(data: Mapping[str, Any]) -> tuple[str, Source] | None:
    """The device ("cpu", "cuda:1", "predicted T4 (16 GiB)") and source memlab wrote beside a
    timeline it saved (`MemoryReport.to_snapshot`); None for torch's own files, and for values
    no memlab report holds."""
    device, source = data.get("memlab_device"), data.get("memlab_source")
    if data.get("written_by") != "memlab" or not isinstance(device, str):
        return None
    if not 0 < len(device) <= 80 or not device.isprintable() or source not in Source.values():
        return None
    return device, Source(source)


def largest(t: Trace, n: int = TOP) -> tuple[Allocation, ...]:
    """The ``n`` biggest allocations of the trace, biggest first (ties: the earliest)."""
    order = np.lexsort((t.a_start, -t.a_size))[:n]
    return tuple(
        Allocation(
            size=int(t.a_size[i]),
            line=t.lines[int(t.a_line[i])],
            made=float(t.a_start[i]),
            freed=None if np.isnan(t.a_end[i]) else float(t.a_end[i]),
            group=GROUPS[int(t.a_group[i])],
        )
        for i in order
    )
