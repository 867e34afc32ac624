"""`load_snapshot`: a file written by ``torch.cuda.memory._dump_snapshot``, read safely, into a
`Snapshot` report."""

from __future__ import annotations

import contextlib
import heapq
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from memlab.core.frames import users_traceback
from memlab.reports.units import fmt_bytes
from memlab.snapshot.collect import Collector, Frames
from memlab.snapshot.faults import LAYOUT_ERRORS, segments_fault
from memlab.snapshot.limits import _PASS, check_counts, check_values
from memlab.snapshot.result import TOP, Allocation, Snapshot, largest, origin_of
from memlab.snapshot.stream import stream
from memlab.snapshot.trace import Trace, busiest, choose, reserving_most, source_line
from memlab.snapshot.unpickle import SnapshotError, check_path


@users_traceback()
def load_snapshot(
    path: str | os.PathLike[str],
    device: int | None = None,
    *,
    first_view: Callable[[Snapshot], object] | None = None,
    progress: Callable[[int, int], object] | None = None,
) -> Snapshot:
    """Read a memory snapshot (``torch.cuda.memory._dump_snapshot(path)``, torch 2.4 and later;
    gzipped too) into a `Snapshot`: its peak, timeline, largest allocations with the line that
    made each, live blocks and fragmentation. ``device``: which GPU's trace (default: the one
    with the most events). The file is read by a restricted unpickler that refuses any Python
    global, so no code in it runs, and its events are taken out as it is read, so memory stays
    far below the file's size (`memlab.snapshot.stream`).

    ``first_view``: called with a `Snapshot` of the cache's state at the end (allocated,
    reserved, free cache, largest free block, fragmentation, the biggest live blocks: torch
    writes them before the trace) as soon as it is read, before the trace; in a notebook,
    ``first_view=display``. ``progress``: called every few MiB with (bytes read, bytes in the
    file); when it returns False the reading stops and the events read so far are the trace
    (a note says where it stopped). Ctrl-C stops it too (``KeyboardInterrupt``, nothing kept)."""
    _check_callable(first_view, "first_view")
    _check_callable(progress, "progress")
    path = check_path(path)
    name = str(path)

    def segments_read(segments: list[dict[str, Any]]) -> None:
        check_blocks(segments, name)
        if first_view is not None:
            with _layout_checked(name, segments):
                view = first_look(segments, name, device)
            first_view(view)

    data, collectors, frames = stream(path, on_segments=segments_read, progress=progress)
    counts = [collectors[i].events for i in range(len(collectors))]
    dev = choose(device, counts)
    with _layout_checked(name, data.get("segments")):
        devices = {int(s.get("device", 0)) for s in data["segments"]}
        if device is None and not any(counts):  # no event: the device the segments are of
            dev = reserving_most(data["segments"]) or dev
    if device is not None and not collectors and device not in devices:
        raise ValueError(  # no trace: the segments say which devices the snapshot holds
            f"device={device!r}: the snapshot has no trace and holds segments of device(s) "
            f"{', '.join(map(str, sorted(devices))) or 'none'}; pass one of those, or None."
        )
    check_blocks(data["segments"], name)
    with _layout_checked(name, data.get("segments")):
        collector = collectors.get(dev) or Collector(frames)
        trace = collector.finish(data["segments"], dev)
        cancelled = data.get("cancelled_at")
        state = None if cancelled is None else f"cancelled at {fmt_bytes(cancelled)}"
        return _report(data, name, dev, trace, collector.events, frames.line, state)


def check_blocks(segments: Any, name: str) -> None:
    """A `SnapshotError` where ``segments`` are too many or list too many blocks
    (`memlab.snapshot.limits.check_counts`), or hold an impossible device or size
    (`~memlab.snapshot.limits.check_values`)."""
    check_counts(segments, name)
    check_values(segments, name)


@contextlib.contextmanager
def _layout_checked(name: str, segments: Any) -> Iterator[None]:
    """A pickle of plain data whose fields are not torch's (a number where a list of segments
    goes, a block without a size) is a `SnapshotError` naming the file and the field
    (`memlab.snapshot.faults`), not a bare TypeError. Where no field is found at fault the error
    may be memlab's own: it is said with its cause, whose frames are kept to be reported."""
    try:
        yield
    except SnapshotError:
        raise
    except LAYOUT_ERRORS as e:
        fault = segments_fault(segments)
        if fault is None and isinstance(e, RecursionError):
            fault = "a value nested deeper than Python reads"
        if fault is not None:  # the file's: said at the user's line
            raise SnapshotError(
                f"{name} is not laid out as a memory snapshot ({fault}): {_PASS}"
            ) from None
        raise SnapshotError(
            f"{name} is not laid out as a memory snapshot ({type(e).__name__}: {e}): pass a "
            "file written by torch.cuda.memory._dump_snapshot."
        ) from e


def first_look(segments: list[dict[str, Any]], name: str, device: int | None = None) -> Snapshot:
    """A `Snapshot` of the segments alone (no trace): the cache's state at the end, on
    ``device`` (default: the one that reserves the most)."""
    if device is None:
        reserved: dict[int, int] = {}
        for s in segments:
            d = int(s.get("device", 0))
            reserved[d] = reserved.get(d, 0) + int(s.get("total_size", 0))
        device = max(reserved, key=reserved.__getitem__, default=0)
    trace = Collector(Frames()).finish(segments, device)
    return _report({"segments": segments}, name, device, trace, 0, source_line, "first view")


def _check_callable(f: object, name: str) -> None:
    if f is not None and not callable(f):
        raise TypeError(
            f"{name}={f!r} is a {type(f).__name__}: pass a function (in a notebook, "
            f"{name}=display), or None."
        )


@users_traceback()
def from_dict(data: Mapping[str, Any], name: str, device: int | None = None) -> Snapshot:
    """A `Snapshot` from a snapshot dict (``torch.cuda.memory._snapshot()``)."""
    if not isinstance(data, Mapping):
        raise TypeError(
            f"data={data!r:.60} is a {type(data).__name__}: pass the dict that "
            "torch.cuda.memory._snapshot() returns."
        )
    check_blocks(data.get("segments", ()), str(name))
    dev, events = busiest(data, device)
    with _layout_checked(str(name), data.get("segments", ())):
        collector = Collector(Frames())
        collector.add(events)
        trace = collector.finish(data.get("segments", ()), dev)
        return _report(data, name, dev, trace, collector.events, source_line)


def _report(
    data: Mapping[str, Any],
    name: str,
    dev: int,
    trace: Trace,
    events: int,
    line: Callable[[Any], str],
    state: str | None = None,
) -> Snapshot:
    segments = [s for s in data.get("segments", ()) if s.get("device", dev) == dev]
    active, free, allocated, internal = [], [], 0, 0
    for s in segments:  # (one pass: a snapshot can hold a million blocks)
        for b in s.get("blocks", ()):
            size = int(b["size"])
            if str(b.get("state", "")).startswith("active"):
                active.append(b)
                allocated += size
                internal += size - int(b.get("requested_size", size))
            else:
                free.append(size)
    notes = []
    if state == "first view":
        notes.append(
            "first view: the cache's state at the end (the segments); the trace is being read, "
            "the peak and the timeline come with it"
        )
    elif state is not None:
        notes.append(
            f"the reading was {state} of the file: the trace holds the events read before; "
            "allocated, reserved and the free cache are the segments' (the state at the end)"
        )
    elif not events:
        notes.append(
            "no events recorded: call torch.cuda.memory._record_memory_history() before the code, "
            "then _dump_snapshot(); the figures are the segments' at the end"
        )
    elif not trace.timed:
        notes.append("the events carry no time_us: the timeline's x axis counts events")
    end = int(trace.totals[-1]) if len(trace.totals) else trace.before
    if events and end != allocated and state is None:
        notes.append(
            f"the trace ends at {fmt_bytes(end)} allocated but the segments hold "
            f"{fmt_bytes(allocated)}: part of the trace was lost (max_entries) or the snapshot "
            "was taken on another stream's schedule"
        )
    if trace.before:
        notes.append(
            f"{fmt_bytes(trace.before)} were allocated before the trace began (no frames for "
            "them); they are the timeline's floor"
        )
    for t, size, device_free in trace.ooms:
        notes.append(
            f"out of memory at {t:.3f} s: {fmt_bytes(size)} asked for, "
            f"{fmt_bytes(device_free)} free on the device"
        )
    live = heapq.nlargest(TOP, active, key=lambda b: int(b["size"]))
    return Snapshot(
        path=name,
        device=dev,
        events=events,
        allocated=allocated,
        reserved=sum(int(s.get("total_size", 0)) for s in segments),
        segments=len(segments),
        free_cache=sum(free),
        largest_free=max(free, default=0),
        internal_free=internal,
        live=tuple(Allocation(size=int(b["size"]), line=line(b.get("frames"))) for b in live),
        top=largest(trace),
        trace=trace,
        notes=tuple(notes),
        origin=origin_of(data),
    )
