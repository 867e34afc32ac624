"""Turning a snapshot's events into a `Trace`, a batch at a time: `Collector` takes events in
the order recorded (all at once from a loaded dict, or batch by batch from `memlab.snapshot.
stream` while the file is read) and keeps only compact arrays."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from memlab.snapshot.faults import LAYOUT_ERRORS, READ, refuse_event
from memlab.snapshot.limits import check_event_size, event_size_refused
from memlab.snapshot.trace import (
    _BY_NAME,
    BEFORE,
    Trace,
    blocks_of,
    busiest,
    phase_of,
    source_line,
)
from memlab.snapshot.unpickle import SnapshotError


class Known(tuple[int, int]):
    """A stack already read: (index of its source line, its group)."""


class Frames:
    """Source lines and groups of stacks, each stack read once; shared by all devices."""

    def __init__(self) -> None:
        self.lines: dict[str, int] = {}
        self.names: list[str] = []  # the lines, by index
        self._by_ids: dict[tuple[int, ...], Known] = {}
        self._known: dict[tuple[int, int], Known] = {}

    def of(self, frames: Any) -> Known:
        """The reading of a list of frames (innermost first), or of one already read."""
        if frames and frames[0] is READ:
            return cast(Known, frames[1])
        frames = frames or ()
        key = tuple(map(id, frames))  # torch shares one dict per distinct frame: ids name a stack
        known = self._by_ids.get(key)
        if known is None:
            text = source_line(frames)
            line = self.lines.setdefault(text, len(self.lines))
            if line == len(self.names):
                self.names.append(text)
            pair = (line, phase_of(frames))
            known = self._by_ids[key] = self._known.setdefault(pair, Known(pair))
        return known

    def line(self, frames: Any) -> str:
        """The source line of a list of frames, read or not."""
        return self.names[self.of(frames)[0]]


class Collector:
    """One device's events, in order, into arrays."""

    def __init__(self, frames: Frames) -> None:
        self.frames = frames
        self.events = 0
        # compact arrays (8 bytes an entry or less), not lists of Python numbers
        self.times, self.rel, self.deltas, self.owner, self.reserved = (
            array("d"),
            *(array("q") for _ in range(4)),
        )
        self.groups = array("b")
        self.a_start, self.a_end, self.a_size = array("d"), array("d"), array("q")
        self.a_group, self.a_line = array("b"), array("i")
        self.a_shape: dict[int, str] = {}
        self.live: dict[int, int] = {}
        self.ooms: list[tuple[float, int, int]] = []
        self.total = self.res = self.unmatched = 0
        self.t0: float | None = None
        self.timed = True

    def add(self, events: Iterable[Mapping[str, Any]]) -> None:
        frames_of, live = self.frames.of, self.live
        a_end, a_group = self.a_end, self.a_group
        total, res, unmatched = self.total, self.res, self.unmatched
        for e in events:
            try:  # (no cost where nothing raises)
                if self.t0 is None:
                    self.timed = "time_us" in e
                    self.t0 = float(e.get("time_us", 0))
                action = e.get("action")
                i = self.events
                self.events += 1
                t = (float(e.get("time_us", self.t0)) - self.t0) / 1e6 if self.timed else float(i)
                try:
                    size = int(e.get("size", 0))
                except (TypeError, ValueError, OverflowError):  # (a list, a word, nan, inf)
                    event_size_refused(e.get("size"))
                if size < 0:
                    check_event_size(size)
                if action == "alloc":
                    line, phase = frames_of(e.get("frames"))
                    group = _BY_NAME.get(e.get("phase", ""), phase)
                    k = live[int(e.get("addr", 0))] = len(self.a_size)
                    self.a_start.append(t)
                    a_end.append(np.nan)
                    self.a_size.append(size)
                    a_group.append(group)
                    self.a_line.append(line)
                    if "shape" in e:
                        self.a_shape[k] = str(e["shape"])
                    total += size
                    delta = size
                elif action in ("free_completed", "free"):
                    k = live.pop(int(e.get("addr", 0)), -1)
                    if k < 0:  # made before the trace began
                        unmatched += size
                        group = BEFORE
                    else:
                        a_end[k] = t
                        group = a_group[k]
                    total -= size
                    delta = -size
                elif action in ("segment_alloc", "segment_map", "segment_free", "segment_unmap"):
                    res += size if action in ("segment_alloc", "segment_map") else -size
                    continue
                elif action == "oom":
                    self.ooms.append((t, size, int(e.get("device_free", 0))))
                    continue
                else:  # (another action of torch's: passed over; one that is no name: refused)
                    if action is not None and type(action) is not str:
                        refuse_event(e)
                    continue
                self.times.append(t)
                self.rel.append(total)
                self.groups.append(group)
                self.deltas.append(delta)
                self.owner.append(k)
                self.reserved.append(res)
            except SnapshotError:
                raise
            except LAYOUT_ERRORS:
                refuse_event(e)  # (a field of the file's at fault: said at the user's line)
                raise  # (memlab's own error: its frames kept, to be reported)
        self.total, self.res, self.unmatched = total, res, unmatched

    def finish(self, segments: Iterable[Mapping[str, Any]], device: int) -> Trace:
        """The `Trace`, given the snapshot's segments (the state at the end); once: its arrays
        are the collector's own."""
        mine = [s for s in segments if s.get("device", device) == device]
        live_end = {a: size for a, size, active in blocks_of(mine) if active}
        untraced = sum(size for addr, size in live_end.items() if addr not in self.live)
        before = self.unmatched + untraced
        reserved_end = sum(int(s.get("total_size", 0)) for s in mine)
        times = _view(self.times, np.float64)
        if self.timed and not np.isfinite(times).all():
            raise SnapshotError(
                "the snapshot is not laid out as a memory snapshot (an event's time_us is not "
                "a finite number of microseconds: nan or inf): pass a file written by "
                "torch.cuda.memory._dump_snapshot."
            )
        totals, reserved = _view(self.rel, np.int64), _view(self.reserved, np.int64)
        totals += before
        reserved += reserved_end - self.res
        return Trace(
            times=times,
            totals=totals,
            groups=_view(self.groups, np.int8),
            deltas=_view(self.deltas, np.int64),
            owner=_view(self.owner, np.int64),
            reserved=reserved,
            a_start=_view(self.a_start, np.float64),
            a_end=_view(self.a_end, np.float64),
            a_size=_view(self.a_size, np.int64),
            a_group=_view(self.a_group, np.int8),
            a_line=_view(self.a_line, np.int32),
            a_shape=self.a_shape,
            lines=tuple(self.frames.lines),
            before=before,
            timed=self.timed and self.events > 0,
            ooms=tuple(self.ooms),
        )


def _view(values: array[Any], dtype: type[np.generic]) -> npt.NDArray[Any]:
    """``values`` as a numpy array sharing its memory (no copy: a big trace's arrays are the
    biggest thing left in memory). The array can no longer grow, so a `Collector` finishes once."""
    return np.frombuffer(values, dtype=dtype) if len(values) else np.zeros(0, dtype=dtype)


def parse(data: Mapping[str, Any], device: int | None = None) -> tuple[int, Trace]:
    """The device (busiest by default) and its `Trace`, from a loaded snapshot dict."""
    device, events = busiest(data, device)
    c = Collector(Frames())
    c.add(events)
    return device, c.finish(data.get("segments", ()), device)
