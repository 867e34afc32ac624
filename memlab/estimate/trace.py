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

import gzip
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from memlab.core.frames import users_traceback
from memlab.estimate.allocator import CachingAllocator

# The results live in their own module; imported here under their names, as before.
from memlab.estimate.trace_result import Divergence as Divergence
from memlab.estimate.trace_result import ReplayResult as ReplayResult
from memlab.estimate.trace_result import StreamDiff as StreamDiff


def read(path: str | Path) -> Any:
    """A snapshot saved as JSON (``.json``, or gzipped ``.json.gz``), as saved."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip's magic number
        raw = gzip.decompress(raw)
    return json.loads(raw)


def load(path: str | Path) -> list[dict[str, Any]]:
    """The busiest device's trace from a snapshot saved as JSON, gzipped or not (or a plain list
    of events)."""
    return events_of(read(path))


#: What `replay` and `diff` read of an event (`compact` keeps these, not the stack frames).
EVENT_KEYS = ("action", "addr", "size", "stream", "time_us")


def compact(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """A ``torch.cuda.memory._snapshot()`` reduced to what this module reads and small enough to
    store: each device's events (`EVENT_KEYS`), and the segments with their blocks' sizes."""
    block_keys = ("size", "requested_size", "state")
    return {
        "device_traces": [
            [{k: e[k] for k in EVENT_KEYS if k in e} for e in t] for t in snapshot["device_traces"]
        ],
        "segments": [
            {
                **{k: s[k] for k in ("address", "total_size", "stream", "segment_type")},
                "blocks": [{k: b[k] for k in block_keys if k in b} for b in s["blocks"]],
            }
            for s in snapshot["segments"]
        ],
    }


def recorded() -> int:
    """How many events the CUDA allocator has recorded so far on its busiest device (with
    ``torch.cuda.memory._record_memory_history()`` on): where part of a trace starts or ends,
    e.g. one step of a longer run (`replay`'s ``start`` and ``end``)."""
    import torch

    from memlab.core import _torch

    torch.cuda.synchronize()
    return max((len(t) for t in _torch.memory_snapshot()["device_traces"]), default=0)


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


def replay(
    snapshot: Mapping[str, Any] | list[dict[str, Any]],
    start: int = 0,
    end: int | None = None,
    addresses: bool = True,
) -> ReplayResult:
    """Replay a trace (a snapshot, or its list of events) through the allocator model. The
    peaks are taken over events ``start`` to ``end`` (e.g. one step of a longer trace).
    ``addresses=False``: without the driver's segment addresses, as an estimate has none."""
    events = events_of(snapshot)
    end = len(events) if end is None else end
    model = CachingAllocator()
    peaks = [0, 0, 0]  # real reserved, model allocated, model reserved
    handles: dict[int, int] = {}
    real_requested = real_reserved = 0
    pending_segment: int | None = None  # a real segment_alloc waiting for its allocation
    pending_at: int | None = None  # and where the driver put it
    agreed = allocations = 0
    first: Divergence | None = None
    freeing_segments = False
    for i, e in enumerate(events):
        if i == start:  # as the allocator's peak counters after a reset: what is there now
            peaks = [real_reserved, model.stats.allocated, model.stats.reserved]
        action, size, addr = e.get("action"), int(e.get("size", 0)), int(e.get("addr", 0))
        if action != "segment_free":
            freeing_segments = False
        if action == "segment_alloc":
            pending_segment, pending_at = size, addr
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
            at = pending_at if addresses else None
            handles[addr] = model.malloc(size, int(e.get("stream", 0)), at)
            grew = model.stats.reserved - before
            real = f"reserved a {pending_segment:,} B segment" if pending_segment else "reused"
            mine = f"reserved a {grew:,} B segment" if grew else "reused"
            if first is None:
                if (pending_segment or 0) == grew:
                    agreed += 1
                else:
                    first = Divergence(i, e, real, mine)
            pending_segment = pending_at = None
        elif action in ("free_completed", "free_requested"):
            handle = handles.pop(addr, None)  # freed once: requested, then completed
            if handle is not None:
                real_requested -= size
                model.free(handle)
        if start <= i < end:
            now = (real_reserved, model.stats.allocated, model.stats.reserved)
            peaks = [max(p, n) for p, n in zip(peaks, now, strict=True)]
    return ReplayResult(
        events=len(events),
        allocations=allocations,
        agreed=agreed,
        first_divergence=first,
        real_requested=real_requested,
        real_reserved=real_reserved,
        model_allocated=model.stats.allocated,
        model_reserved=model.stats.reserved,
        real_peak_reserved=peaks[0],
        model_peak_allocated=peaks[1],
        model_peak_reserved=peaks[2],
    )


def _allocation_sizes(events: list[dict[str, Any]]) -> tuple[int, ...]:
    return tuple(int(e.get("size", 0)) for e in events if e.get("action") == "alloc")


def diff(
    predicted: Mapping[str, Any] | list[dict[str, Any]],
    real: Mapping[str, Any] | list[dict[str, Any]],
) -> StreamDiff:
    """Set the allocations of a predicted stream (``Estimate.trace``, or a list of events)
    with a real trace's: which allocation first differs, and which sizes one has more often.
    Pass the same part of each (e.g. the measured step: ``events[first:end]``)."""
    mine, theirs = _allocation_sizes(events_of(predicted)), _allocation_sizes(events_of(real))
    first = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
    counts: dict[int, list[int]] = {}
    for k, sizes in enumerate((mine, theirs)):
        for size in sizes:
            counts.setdefault(size, [0, 0])[k] += 1
    differ = [(size, p, r) for size, (p, r) in counts.items() if p != r]
    differ.sort(key=lambda d: -abs(d[1] - d[2]) * d[0])
    return StreamDiff(mine, theirs, first, tuple(differ))


@users_traceback()
def compare(
    predicted: Mapping[str, Any] | list[dict[str, Any]],
    real: Mapping[str, Any] | list[dict[str, Any]],
) -> StreamDiff:
    """Kept for one release: renamed `diff` (``memlab.estimate.compare`` is another thing)."""
    from memlab.core.warn import moved

    moved("memlab.estimate.trace.compare", "memlab.estimate.trace.diff")
    return diff(predicted, real)


def synthetic(steps: Iterable[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """A trace in the snapshot's format from (action, addr, size) triples, for tests and docs."""
    return [{"action": a, "addr": addr, "size": size, "stream": 0} for a, addr, size in steps]
