"""A region's timeline: memory over the region, made into tuples when first read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memlab.core.choices import TimelineSource

_Points = tuple[tuple[float, ...], tuple[int, ...], tuple[str, ...]]
_POINT_FIELDS = ("seconds", "allocated", "phases")


@dataclass(frozen=True)
class Timeline:
    """Memory over the region: seconds since its start, bytes, and the phase of each point."""

    seconds: tuple[float, ...]
    allocated: tuple[int, ...]
    phases: tuple[str, ...]
    source: TimelineSource

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", TimelineSource.parse("source", self.source))

    @classmethod
    def deferred(
        cls, points: Callable[[], _Points], n: int, source: TimelineSource | str
    ) -> Timeline:
        """A timeline of ``n`` points whose tuples ``points()`` makes on first use: every
        region with a breakdown has a timeline, and most are never looked at."""
        made = object.__new__(cls)
        object.__setattr__(made, "source", TimelineSource.parse("source", source))
        object.__setattr__(made, "_points", points)
        object.__setattr__(made, "_n", n)
        return made

    def __getattr__(self, name: str) -> Any:
        # (only for an attribute not set: the points of a deferred timeline, made here once)
        found = self.__dict__
        if name in _POINT_FIELDS:
            if name in found:  # (made by another thread meanwhile)
                return found[name]
            points = found.get("_points")
            if points is not None:
                for field_name, value in zip(_POINT_FIELDS, points(), strict=True):
                    object.__setattr__(self, field_name, value)
                found.pop("_points", None)
                return found[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self) -> dict[str, Any]:
        # (pickled and copied with its points made: the maker is a closure)
        return {f: getattr(self, f) for f in (*_POINT_FIELDS, "source")}

    def __len__(self) -> int:
        n = self.__dict__.get("_n")
        return n if n is not None and "_points" in self.__dict__ else len(self.seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": list(self.seconds),
            "allocated": list(self.allocated),
            "phases": list(self.phases),
            "source": str(self.source),
        }
