"""`RankTable`: one measured region on every rank of a distributed job, side by side."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memlab.core.categories import Category
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
        return cls.from_dict(report.to_dict(), rank)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], rank: int) -> RankRow:
        """From a `MemoryReport`'s ``to_dict()`` (as `gather` sends it), checked field by field:
        the data came from another process."""
        where = f"rank {rank}"
        if not isinstance(d, Mapping):
            raise RankDataError(f"{where}: expected a report's to_dict(), got {type(d).__name__}")
        cats = d.get("categories") or {}
        if not isinstance(cats, Mapping):
            raise RankDataError(f"{where}: 'categories' must be a mapping")
        timeline = d.get("timeline")
        phase = "n/a"
        if isinstance(timeline, Mapping) and timeline.get("allocated"):
            allocated, phases = timeline["allocated"], timeline.get("phases") or []
            i = max(range(len(allocated)), key=allocated.__getitem__)
            phase = str(phases[i]) if i < len(phases) else "n/a"
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

    def categories(self, at: str = "at_peak") -> list[Category]:
        return [c for c in SHOWN if any(getattr(r, at).get(c) for r in self.rows)]

    def lines(self) -> list[tuple[str, list[int | str]]]:
        """The table's rows as (name, one figure per rank), the same for text and HTML."""
        out: list[tuple[str, list[int | str]]] = [
            ("peak", [r.peak for r in self.rows]),
            ("peak phase", [r.peak_phase for r in self.rows]),
        ]
        out += [
            (f"  {c.value}", [r.at_peak.get(c, 0) for r in self.rows]) for c in self.categories()
        ]
        out.append(("at end", [r.after for r in self.rows]))
        out += [
            (f"  {c.value}", [r.at_end.get(c, 0) for r in self.rows])
            for c in self.categories("at_end")
        ]
        return out

    def title(self) -> str:
        on = f" · {self.backend}" if self.backend else ""
        return f"memlab · {self.world_size} rank{'s' if self.world_size != 1 else ''}{on}"

    def notes(self) -> list[str]:
        return [f"rank {r.rank}: {n}" for r in self.rows for n in r.notes]

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
        rows = []
        for i, r in enumerate(ranks):
            row = RankRow.from_dict(r, i)
            rows.append(RankRow(**{**row.__dict__, "peak_phase": str(r.get("peak_phase"))}))
        return cls(tuple(rows), str(d.get("backend", "")))

    def text(self) -> str:
        from memlab.reports.units import fmt_bytes

        head = f"{self.title():34}" + "".join(f"{'rank ' + str(r.rank):>11}" for r in self.rows)
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
                table(["", *(f"rank {r.rank}" for r in self.rows)], rows, "memlab-ranks-table"),
                *(note(n) for n in self.notes()),
            ]
        )
