"""`load_snapshot`: a file written by ``torch.cuda.memory._dump_snapshot``, read safely, into a
`Snapshot` report."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from memlab.reports.units import fmt_bytes
from memlab.snapshot.collect import Collector, Frames
from memlab.snapshot.result import TOP, Allocation, Snapshot, largest
from memlab.snapshot.stream import stream
from memlab.snapshot.trace import Trace, busiest, choose, source_line


def load_snapshot(path: str | Path, device: int | None = None) -> Snapshot:
    """Read a memory snapshot (``torch.cuda.memory._dump_snapshot(path)``, torch 2.4 and later;
    gzipped too) into a `Snapshot`: its peak, timeline, largest allocations with the line that
    made each, live blocks and fragmentation. ``device``: which GPU's trace (default: the one
    with the most events). The file is read by a restricted unpickler that refuses any Python
    global, so no code in it runs, and its events are taken out as it is read, so memory stays
    far below the file's size (`memlab.snapshot.stream`)."""
    data, collectors, frames = stream(path)
    dev = choose(device, [collectors[i].events for i in range(len(collectors))])
    collector = collectors.get(dev) or Collector(frames)
    trace = collector.finish(data["segments"], dev)
    return _report(data, str(path), dev, trace, collector.events, frames.line)


def from_dict(data: Mapping[str, Any], name: str, device: int | None = None) -> Snapshot:
    """A `Snapshot` from a snapshot dict (``torch.cuda.memory._snapshot()``)."""
    dev, events = busiest(data, device)
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
) -> Snapshot:
    segments = [s for s in data.get("segments", ()) if s.get("device", dev) == dev]
    blocks = [b for s in segments for b in s.get("blocks", ())]
    active = [b for b in blocks if str(b.get("state", "")).startswith("active")]
    free = [int(b["size"]) for b in blocks if not str(b.get("state", "")).startswith("active")]
    allocated = sum(int(b["size"]) for b in active)
    notes = []
    if not events:
        notes.append(
            "no events recorded: call torch.cuda.memory._record_memory_history() before the code, "
            "then _dump_snapshot(); the figures are the segments' at the end"
        )
    elif not trace.timed:
        notes.append("the events carry no time_us: the timeline's x axis counts events")
    end = int(trace.totals[-1]) if len(trace.totals) else trace.before
    if events and end != allocated:
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
    live = sorted(active, key=lambda b: -int(b["size"]))[:TOP]
    return Snapshot(
        path=name,
        device=dev,
        events=events,
        allocated=allocated,
        reserved=sum(int(s.get("total_size", 0)) for s in segments),
        segments=len(segments),
        free_cache=sum(free),
        largest_free=max(free, default=0),
        internal_free=sum(int(b["size"]) - int(b.get("requested_size", b["size"])) for b in active),
        live=tuple(Allocation(size=int(b["size"]), line=line(b.get("frames"))) for b in live),
        top=largest(trace),
        trace=trace,
        notes=tuple(notes),
    )
