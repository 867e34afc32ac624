"""What a report shows, independent of the medium: text and HTML both render this layout."""

from __future__ import annotations

from dataclasses import dataclass

from memlab.core.categories import DESCRIPTIONS, Category
from memlab.core.choices import PeakScope, Source
from memlab.reports.report import PEAK_SCOPES, MemoryReport
from memlab.reports.units import fmt_bytes, fmt_label, fmt_seconds


@dataclass(frozen=True)
class Row:
    name: str
    before: int | None
    after: int | None
    peak: int | None

    @property
    def delta(self) -> int | None:
        return None if self.before is None or self.after is None else self.after - self.before

    @property
    def peak_delta(self) -> int | None:
        return None if self.before is None or self.peak is None else self.peak - self.before


@dataclass(frozen=True)
class CategoryRow:
    category: Category
    at_peak: int
    at_end: int
    description: str


@dataclass(frozen=True)
class Layout:
    title: str
    subtitle: str
    rows: tuple[Row, ...]
    categories: tuple[CategoryRow, ...]
    notes: tuple[str, ...]


def layout(r: MemoryReport) -> Layout:
    parts = ["memlab", r.device]
    if r.label:
        parts.append(fmt_label(r.label))
    if r.source != Source.ESTIMATE:  # a prediction's run time is the meta run's, not a GPU's
        parts.append(fmt_seconds(r.seconds))
    if r.raised == "KeyboardInterrupt":
        parts.append("INTERRUPTED")
    if r.source == Source.CUDA_ALLOCATOR:
        subtitle = "CUDA caching allocator"
    elif r.source == Source.ESTIMATE:
        subtitle = "PREDICTED: a meta-device run replayed through a model of the CUDA allocator"
    elif r.source == Source.CPU_ALLOCATOR:
        subtitle = "CPU allocator's own record: every allocation, inside compiled code too"
    else:
        subtitle = "tensor accounting: exact bytes of the tensor storages memlab saw"
    rows = [Row("allocated", r.allocated_before, r.allocated_after, r.peak_allocated)]
    if r.reserved_before is not None:
        rows.append(Row("reserved", r.reserved_before, r.reserved_after, r.peak_reserved))
    if r.host is not None:
        rows.append(Row("host", r.host.before, r.host.after, r.host.peak))
    cats: list[CategoryRow] = []
    if r.breakdown is not None:
        for c in Category:
            p, e = r.breakdown.at_peak.get(c, 0), r.breakdown.at_end.get(c, 0)
            if p or e:
                cats.append(CategoryRow(c, p, e, DESCRIPTIONS[c]))
    notes = list(r.notes) + (r.host.lines() if r.host is not None else [])
    if r.peak_scope != PeakScope.REGION:
        notes.append(f"peak: {PEAK_SCOPES[r.peak_scope]}")
    if r.alloc_retries:
        notes.append(
            f"{r.alloc_retries} allocation retr{'y' if r.alloc_retries == 1 else 'ies'}: the "
            "allocator freed its cache to satisfy a request (memory is tight)"
        )
    if r.ooms:
        notes.append(f"{r.ooms} out-of-memory error(s) inside the region")
    if r.driver is not None:
        d = r.driver
        used = d.total - d.free
        text = f"driver: {fmt_bytes(used)} of {fmt_bytes(d.total)} in use on the device"
        if d.process_used is not None:
            text += f"; this process {fmt_bytes(d.process_used)}"
        if r.reserved_after is not None:
            text += (
                f" (reserved {fmt_bytes(r.reserved_after)}; the rest is the CUDA context, "
                "libraries and other processes)"
            )
        notes.append(text)
    if r.raised == "KeyboardInterrupt":
        notes.append("interrupted (KeyboardInterrupt): figures cover the region up to that point")
    elif r.raised:
        notes.append(f"the region raised {r.raised}; figures cover it up to that point")
    return Layout(" · ".join(parts), subtitle, tuple(rows), tuple(cats), tuple(notes))
