"""`RankTable`: one measured region on every rank of a distributed job, side by side."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memlab.core.categories import Category
from memlab.core.recorder import Phase
from memlab.reports.frame import NAME, heading, note, num_cell, table, text_cell
from memlab.reports.protocol import Result
from memlab.reports.report import MemoryReport

#: The categories a table shows, in this order (a category no rank holds is left out).
SHOWN = (
    Category.PARAMETER,
    Category.GRADIENT,
    Category.OPTIMIZER_STATE,
    Category.ACTIVATION,
    Category.COMMUNICATION,
    Category.BUFFER,
    Category.INPUT,
    Category.TEMPORARY,
    Category.OTHER,
)


#: Ranks a table shows at most (`RankTable.shown`).
MAX_SHOWN = 8
#: What `RankRow.peak_phase` may say.
PHASES = (*Phase.NAMES, "n/a")


class RankDataError(ValueError):
    """A rank's report, as JSON, is not what `gather` sends."""


def _bytes(d: Mapping[str, Any], key: str, where: str) -> int:
    v = d.get(key)
    if type(v) is not int or v < 0:
        raise RankDataError(f"{where}: {key!r} must be a byte count (an int ≥ 0), got {v!r}")
    return v


def _categories(d: Any, where: str) -> dict[Category, int]:
    if d is None:
        return {}
    if not isinstance(d, Mapping):
        raise RankDataError(f"{where}: categories must be a mapping, got {type(d).__name__}")
    known = {c.value: c for c in Category}
    return {known[k]: _bytes(d, k, where) for k in d if k in known and d[k]}


@dataclass(frozen=True)
class RankRow:
    """One rank's region: totals, the peak and what the program was doing at it, and the bytes
    by category at the peak and at the end."""

    rank: int
    device: str
    before: int
    after: int
    peak: int
    #: forward, backward, optimizer, other; "n/a" without a timeline (``track(timeline=True)``).
    peak_phase: str
    at_peak: Mapping[Category, int] = field(default_factory=dict)
    at_end: Mapping[Category, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @classmethod
    def from_report(cls, report: MemoryReport, rank: int) -> RankRow:
        """One rank's row, from its region's report (the phase of the peak from its timeline)."""
        phase = "n/a"
        timeline = report.timeline
        if timeline is not None and len(timeline):
            i = max(range(len(timeline)), key=timeline.allocated.__getitem__)
            phase = timeline.phases[i]
        b = report.breakdown
        return cls(
            rank=rank,
            device=report.device,
            before=report.allocated_before,
            after=report.allocated_after,
            peak=report.peak_allocated,
            peak_phase=phase,
            at_peak=dict(b.at_peak) if b is not None else {},
            at_end=dict(b.at_end) if b is not None else {},
            notes=report.notes,
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], rank: int) -> RankRow:
        """From ``to_dict()`` (as `gather` sends it), checked field by field: the data came from
        another process."""
        where = f"rank {rank}"
        if not isinstance(d, Mapping):
            raise RankDataError(f"{where}: expected a RankRow's to_dict(), got {type(d).__name__}")
        cats = d.get("categories") or {}
        if not isinstance(cats, Mapping):
            raise RankDataError(f"{where}: 'categories' must be a mapping")
        phase = d.get("peak_phase", "n/a")
        if phase not in PHASES:
            raise RankDataError(f"{where}: 'peak_phase' must be one of {PHASES}, got {phase!r}")
        notes = d.get("notes") or []
        return cls(
            rank=rank,
            device=str(d.get("device", "?")),
            before=_bytes(d, "allocated_before", where),
            after=_bytes(d, "allocated_after", where),
            peak=_bytes(d, "peak_allocated", where),
            peak_phase=phase,
            at_peak=_categories(cats.get("at_peak"), where),
            at_end=_categories(cats.get("at_end"), where),
            notes=tuple(str(n) for n in notes) if isinstance(notes, list) else (),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "device": self.device,
            "allocated_before": self.before,
            "allocated_after": self.after,
            "peak_allocated": self.peak,
            "peak_phase": self.peak_phase,
            "categories": {
                "at_peak": {c.value: b for c, b in self.at_peak.items()},
                "at_end": {c.value: b for c, b in self.at_end.items()},
            },
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class RankTable(Result):
    """Every rank's figures for one region (`memlab.distributed.gather`): ``rows[r]`` is rank
    ``r``'s `RankRow`."""

    css = "memlab-ranks"

    rows: tuple[RankRow, ...]
    backend: str = ""

    @property
    def world_size(self) -> int:
        return len(self.rows)

    def shown(self) -> tuple[RankRow, ...]:
        """The ranks the text and HTML show: all of them up to `MAX_SHOWN`; beyond, the first
        ones, the rank with the highest peak and the last (``to_dict()`` keeps every rank)."""
        rows = self.rows
        if len(rows) <= MAX_SHOWN:
            return rows
        highest = max(rows, key=lambda r: r.peak)
        picked = {r.rank: r for r in (*rows[: MAX_SHOWN - 2], highest, rows[-1])}
        return tuple(picked[k] for k in sorted(picked))

    def categories(self, at: str = "at_peak") -> list[Category]:
        return [c for c in SHOWN if any(getattr(r, at).get(c) for r in self.rows)]

    def lines(self) -> list[tuple[str, list[int | str]]]:
        """The table's rows as (name, one figure per rank shown), the same for text and HTML."""
        rows = self.shown()
        out: list[tuple[str, list[int | str]]] = [
            ("peak", [r.peak for r in rows]),
            ("peak phase", [r.peak_phase for r in rows]),
        ]
        out += [(f"  {c.value}", [r.at_peak.get(c, 0) for r in rows]) for c in self.categories()]
        out.append(("at end", [r.after for r in rows]))
        out += [
            (f"  {c.value}", [r.at_end.get(c, 0) for r in rows]) for c in self.categories("at_end")
        ]
        return out

    def title(self) -> str:
        on = f" · {self.backend}" if self.backend else ""
        return f"memlab · {self.world_size} rank{'s' if self.world_size != 1 else ''}{on}"

    def notes(self) -> list[str]:
        shown = self.shown()
        notes = [f"rank {r.rank}: {n}" for r in shown for n in r.notes]
        if len(shown) < len(self.rows):
            ranks = ", ".join(str(r.rank) for r in shown)
            notes.append(
                f"{len(self.rows)} ranks: showing ranks {ranks} (the first ones, the highest "
                "peak, the last); to_dict() has every rank"
            )
        return notes

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "backend": self.backend,
            "ranks": [r.to_dict() for r in self.rows],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankTable:
        """A table from its ``to_dict()`` (how `launch` brings rank 0's table home)."""
        ranks = d.get("ranks") if isinstance(d, Mapping) else None
        if not isinstance(ranks, list):
            raise RankDataError("a RankTable's to_dict() has a list under 'ranks'")
        rows = tuple(RankRow.from_dict(r, i) for i, r in enumerate(ranks))
        return cls(rows, str(d.get("backend", "")))

    def text(self) -> str:
        from memlab.reports.units import fmt_bytes

        head = f"{self.title():34}" + "".join(f"{'rank ' + str(r.rank):>11}" for r in self.shown())
        body = [
            f"{name:34}"
            + "".join(f"{v if isinstance(v, str) else fmt_bytes(v):>11}" for v in figures)
            for name, figures in self.lines()
        ]
        return "\n".join([head, *body, *(f"  note: {n}" for n in self.notes())])

    def html(self) -> str:
        rows = [
            text_cell(
                name.strip(), NAME if not name.startswith(" ") else NAME + ";padding-left:12px"
            )
            + "".join(text_cell(v) if isinstance(v, str) else num_cell(v) for v in figures)
            for name, figures in self.lines()
        ]
        return "\n".join(
            [
                heading(
                    self.title(), "tensor bytes per rank: at the region's peak, and at its end"
                ),
                table(["", *(f"rank {r.rank}" for r in self.shown())], rows, "memlab-ranks-table"),
                *(note(n) for n in self.notes()),
            ]
        )
