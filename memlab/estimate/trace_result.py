"""What `memlab.estimate.trace` finds: a replay's agreement with the real allocator
(`ReplayResult`), and how a predicted allocation stream differs from a real one (`StreamDiff`).

The text gives exact bytes (the validation compares them to the byte); the HTML human units with
the exact bytes on hover.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from memlab.reports.frame import CELL, NAME, heading, note, num_cell, table, text_cell, warning
from memlab.reports.protocol import Result


@dataclass(frozen=True)
class Divergence:
    index: int  # the trace event's position
    event: Mapping[str, Any]
    real: str
    model: str

    def __str__(self) -> str:
        e = self.event
        return (
            f"event {self.index} ({e.get('action')} of {e.get('size', 0):,} B): the allocator "
            f"{self.real}, the model {self.model}"
        )

    def to_dict(self) -> dict[str, Any]:
        event = {k: self.event[k] for k in ("action", "addr", "size", "stream") if k in self.event}
        return {"index": self.index, "event": event, "real": self.real, "model": self.model}


@dataclass(frozen=True)
class ReplayResult(Result):
    css = "memlab-replay"

    events: int
    allocations: int
    #: Allocations both sides served the same way (same segment decision) before the first
    #: divergence.
    agreed: int
    first_divergence: Divergence | None
    #: Bytes requested and not yet freed at the end (a trace records requests, not blocks).
    real_requested: int
    real_reserved: int
    model_allocated: int
    model_reserved: int
    #: Peaks over the events from ``start`` to ``end`` (the whole trace by default): the real
    #: allocator's reserved bytes (read from its segment events) and the model's allocated and
    #: reserved bytes. A trace holds requested sizes only, so the real peak *allocated* (blocks)
    #: is not in it: compare the model's with ``torch.cuda.max_memory_allocated()``.
    real_peak_reserved: int = 0
    model_peak_allocated: int = 0
    model_peak_reserved: int = 0

    @property
    def exact(self) -> bool:
        """Every segment decision agreed and both end with the same reserved bytes."""
        return self.first_divergence is None and self.real_reserved == self.model_reserved

    @property
    def summary(self) -> str:
        return (
            f"{self.events:,} events, {self.allocations:,} allocations; the model agreed on "
            f"{self.agreed:,} before "
            + ("the end" if self.first_divergence is None else "diverging")
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        div = self.first_divergence
        d["first_divergence"] = None if div is None else div.to_dict()
        return {**d, "exact": self.exact}

    def text(self) -> str:
        lines = [
            self.summary,
            f"at the end: requested {self.real_requested:,} B; the model's blocks "
            f"{self.model_allocated:,} B",
            f"reserved at the end:  real {self.real_reserved:,} B, model {self.model_reserved:,} B",
            f"peak reserved:        real {self.real_peak_reserved:,} B, model "
            f"{self.model_peak_reserved:,} B",
        ]
        if self.first_divergence is not None:
            lines.append(f"first divergence: {self.first_divergence}")
        return "\n".join(lines)

    def html(self) -> str:
        rows = [
            text_cell(name, NAME) + num_cell(real) + num_cell(model)
            for name, real, model in (
                (
                    "requested (real) / blocks (model) at the end",
                    self.real_requested,
                    self.model_allocated,
                ),
                ("reserved at the end", self.real_reserved, self.model_reserved),
                ("peak reserved", self.real_peak_reserved, self.model_peak_reserved),
                ("peak allocated", None, self.model_peak_allocated),
            )
        ]
        out = [
            heading(self.summary, "the allocator model replaying a real trace"),
            table(["", "real", "model"], rows, "memlab-replay-table"),
        ]
        if self.first_divergence is not None:
            out.append(warning(f"first divergence: {self.first_divergence}"))
        elif self.exact:
            out.append(note("exact: every segment decision and the reserved bytes agree"))
        return "\n".join(out)


@dataclass(frozen=True)
class StreamDiff(Result):
    """How a predicted allocation stream differs from a real one (requested sizes, in order)."""

    css = "memlab-stream-diff"

    predicted: tuple[int, ...]
    real: tuple[int, ...]
    #: Position of the first allocation whose size differs (None: one stream is a prefix of
    #: the other, or they are the same).
    first: int | None
    #: Sizes requested a different number of times: (size, times predicted, times real), the
    #: largest difference in bytes first.
    counts: tuple[tuple[int, int, int], ...]

    @property
    def same(self) -> bool:
        return self.predicted == self.real

    @property
    def summary(self) -> str:
        return (
            f"predicted {len(self.predicted):,} allocations ({sum(self.predicted):,} B), real "
            f"{len(self.real):,} ({sum(self.real):,} B)"
        )

    def _first(self) -> str | None:
        if self.first is None:
            return None
        i = self.first
        return (
            f"first difference at allocation {i}: predicted "
            f"{list(self.predicted[i : i + 4])}, real {list(self.real[i : i + 4])} "
            f"(after {list(self.real[max(0, i - 3) : i])})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "same": self.same,
            "predicted": list(self.predicted),
            "real": list(self.real),
            "first": self.first,
            "counts": [{"size": s, "predicted": p, "real": r} for s, p, r in self.counts],
        }

    def text(self) -> str:
        if self.same:
            return self.summary + ": the same sizes in the same order"
        first = self._first()
        lines = [self.summary, *([first] if first else [])]
        for size, p, r in self.counts[:8]:
            lines.append(f"  {size:>14,} B: predicted {p} times, real {r}")
        return "\n".join(lines)

    def html(self) -> str:
        if self.same:
            return heading(self.summary, "the same sizes in the same order")
        first = self._first()
        rows = [
            num_cell(size) + text_cell(str(p), CELL) + text_cell(str(r), CELL)
            for size, p, r in self.counts[:8]
        ]
        return "\n".join(
            [
                heading(self.summary),
                *([note(first)] if first else []),
                table(["size", "times predicted", "times real"], rows, "memlab-stream-table"),
            ]
        )
