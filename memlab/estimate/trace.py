"""Replay a real allocator trace through the allocator model, and say where they part ways.

On a GPU, ``torch.cuda.memory._record_memory_history()`` makes the caching allocator log every
event; ``torch.cuda.memory._snapshot()`` returns them under ``"device_traces"``: ``alloc``,
``free_requested`` / ``free_completed``, ``segment_alloc`` / ``segment_free`` (and others), each
with an address, a size and a stream. `replay` feeds the allocations and frees, in order, to
`CachingAllocator` and compares its segment decisions with the real ones: for each allocation,
did the real allocator reserve a new segment just before it, and of what size, and did the model?

The result says how far the two agree (the first event where they don't, and why), and the
allocated and reserved bytes each ends with. Traces small enough to store (a few thousand
events) serve as regression tests for the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memlab.estimate.allocator import CachingAllocator


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


@dataclass(frozen=True)
class ReplayResult:
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

    @property
    def exact(self) -> bool:
        """Every segment decision agreed and both end with the same reserved bytes."""
        return self.first_divergence is None and self.real_reserved == self.model_reserved

    def __str__(self) -> str:
        lines = [
            f"{self.events:,} events, {self.allocations:,} allocations; the model agreed on "
            f"{self.agreed:,} before "
            + ("the end" if self.first_divergence is None else "diverging"),
            f"at the end: requested {self.real_requested:,} B; the model's blocks "
            f"{self.model_allocated:,} B",
            f"reserved at the end:  real {self.real_reserved:,} B, model {self.model_reserved:,} B",
        ]
        if self.first_divergence is not None:
            lines.append(f"first divergence: {self.first_divergence}")
        return "\n".join(lines)


def load(path: str | Path) -> list[dict[str, Any]]:
    """The first device's trace from a snapshot saved as JSON (or a plain list of events)."""
    data = json.loads(Path(path).read_text())
    return events_of(data)


def events_of(snapshot: Mapping[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(snapshot, list):
        return snapshot
    traces = snapshot.get("device_traces")
    if not traces:
        raise ValueError(
            "the snapshot has no device_traces: record it with "
            "torch.cuda.memory._record_memory_history() before the code to trace."
        )
    busiest: list[dict[str, Any]] = max(traces, key=len)
    return busiest


def replay(snapshot: Mapping[str, Any] | list[dict[str, Any]]) -> ReplayResult:
    """Replay a trace (a snapshot, or its list of events) through the allocator model."""
    events = events_of(snapshot)
    model = CachingAllocator()
    handles: dict[int, int] = {}
    real_requested = real_reserved = 0
    pending_segment: int | None = None  # a real segment_alloc waiting for its allocation
    agreed = allocations = 0
    first: Divergence | None = None
    freeing_segments = False
    for i, e in enumerate(events):
        action, size, addr = e.get("action"), int(e.get("size", 0)), int(e.get("addr", 0))
        if action != "segment_free":
            freeing_segments = False
        if action == "segment_alloc":
            pending_segment = size
            real_reserved += size
        elif action == "segment_free":
            real_reserved -= size
            if not freeing_segments:  # empty_cache() or an OOM retry released the cache
                model.empty_cache()
                freeing_segments = True
        elif action == "alloc":
            allocations += 1
            real_requested += size
            before = model.stats.reserved
            handles[addr] = model.malloc(size, int(e.get("stream", 0)))
            grew = model.stats.reserved - before
            real = f"reserved a {pending_segment:,} B segment" if pending_segment else "reused"
            mine = f"reserved a {grew:,} B segment" if grew else "reused"
            if first is None:
                if (pending_segment or 0) == grew:
                    agreed += 1
                else:
                    first = Divergence(i, e, real, mine)
            pending_segment = None
        elif action in ("free_completed", "free_requested"):
            handle = handles.pop(addr, None)  # freed once: requested, then completed
            if handle is not None:
                real_requested -= size
                model.free(handle)
    return ReplayResult(
        events=len(events),
        allocations=allocations,
        agreed=agreed,
        first_divergence=first,
        real_requested=real_requested,
        real_reserved=real_reserved,
        model_allocated=model.stats.allocated,
        model_reserved=model.stats.reserved,
    )


def synthetic(steps: Iterable[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """A trace in the snapshot's format from (action, addr, size) triples, for tests and docs."""
    return [{"action": a, "addr": addr, "size": size, "stream": 0} for a, addr, size in steps]
