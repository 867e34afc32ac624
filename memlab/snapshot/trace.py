"""A snapshot's events as compact arrays: what was allocated when, by whom, and the live total.

The raw snapshot (dicts per event) is read once by `parse` and left behind; what remains is
numpy arrays, one entry an event or an allocation, and a table of source lines. Allocations are
grouped by the phase of the program that made them (forward, backward, optimizer, other), read
from their stack frames, or from the ``phase`` key memlab writes; memory live before the trace
began is its own group.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

#: The groups a timeline is stacked by, bottom first.
GROUPS = ("before the trace", "forward", "backward", "optimizer", "other")
BEFORE, FORWARD, BACKWARD, OPTIMIZER, OTHER = range(len(GROUPS))
_BY_NAME = {g: i for i, g in enumerate(GROUPS)}
#: Frames from these places are the library's, not the user's line.
_LIBRARY = ("/torch/", "\\torch\\", "/memlab/", "<frozen", "/site-packages/")
_NATIVE = (".cpp", ".cu", ".h", ".cc", "??")
#: Allocations kept for hovering, largest first.
HOVER_ALLOCATIONS = 500

Ints = npt.NDArray[np.int64]
Floats = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Trace:
    """One device's events, reduced to arrays.

    ``times``/``totals``/``groups``/``deltas``: one entry per event that changed the allocated
    total: seconds since the first event, the total after it (bytes, with what was live before
    the trace), the group of the allocation it concerns and its signed size.
    ``a_*``: one entry per allocation: when made and freed (``nan`` if live at the end), size,
    group, and the index of its source line in ``lines``.
    """

    times: Floats
    totals: Ints
    groups: npt.NDArray[np.int8]
    deltas: Ints
    owner: npt.NDArray[np.int64]
    reserved: Ints
    a_start: Floats
    a_end: Floats
    a_size: Ints
    a_group: npt.NDArray[np.int8]
    a_line: npt.NDArray[np.int32]
    a_shape: Mapping[int, str]  # allocation -> shape, where the snapshot says
    lines: tuple[str, ...]
    before: int
    timed: bool
    ooms: tuple[tuple[float, int, int], ...]

    @property
    def peak(self) -> int:
        return int(max(self.before, self.totals.max(initial=self.before)))

    @property
    def peak_index(self) -> int | None:
        return int(self.totals.argmax()) if len(self.totals) else None

    def by_group(self) -> npt.NDArray[np.int64]:
        """Live bytes by group after each event: ``[len(GROUPS), len(times)]``."""
        out = np.zeros((len(GROUPS), len(self.deltas)), dtype=np.int64)
        for g in range(len(GROUPS)):
            out[g] = np.cumsum(np.where(self.groups == g, self.deltas, 0))
        out[BEFORE] += self.before
        return out


def source_line(frames: Sequence[Mapping[str, Any]] | None) -> str:
    """The innermost frame that is the user's code (not torch's, not native), as
    ``file.py:12 in fn``; the innermost Python frame when none is; "" without frames."""
    if not frames:
        return ""
    python = [f for f in frames if not str(f.get("filename", "")).endswith(_NATIVE)]
    mine = [f for f in python if not any(p in str(f.get("filename", "")) for p in _LIBRARY)]
    f = (mine or python or list(frames))[0]
    return f"{f.get('filename', '?')}:{f.get('line', '?')} in {f.get('name', '?')}"


def phase_of(frames: Sequence[Mapping[str, Any]] | None) -> int:
    """Which phase made an allocation, read from its Python frames (innermost first)."""
    for f in frames or ():
        name, file = str(f.get("name", "")), str(f.get("filename", ""))
        if "optim" in file and name in ("step", "_use_grad", "wrapper", "_init_group"):
            return OPTIMIZER
        if name in ("backward", "_engine_run_backward", "run_backward"):
            return BACKWARD
        if name == "forward" or name == "_call_impl":
            return FORWARD
    return OTHER


def busiest(data: Mapping[str, Any], device: int | None) -> tuple[int, list[Any]]:
    traces = data.get("device_traces") or []
    if device is None:
        device = max(range(len(traces)), key=lambda i: len(traces[i]), default=0)
    if not isinstance(device, int) or device < 0 or (traces and device >= len(traces)):
        raise ValueError(
            f"device={device!r}: the snapshot has traces for devices 0 to {len(traces) - 1}; "
            "pass one of those, or None for the busiest."
        )
    return device, list(traces[device]) if traces else []


def parse(data: Mapping[str, Any], device: int | None = None) -> tuple[int, Trace]:
    """The device (busiest by default) and its `Trace`."""
    device, events = busiest(data, device)
    lines: dict[str, int] = {}
    by_frames: dict[tuple[int, ...], tuple[int, int]] = {}  # frames' ids -> (line, group)
    # compact arrays (8 bytes an entry or less), not lists of Python numbers
    times, rel, deltas, owner, reserved = (array("d"), *(array("q") for _ in range(4)))
    groups = array("b")
    a_start, a_end, a_size = array("d"), array("d"), array("q")
    a_group, a_line = array("b"), array("i")
    a_shape: dict[int, str] = {}
    live: dict[int, int] = {}
    ooms: list[tuple[float, int, int]] = []
    total = res = unmatched = 0
    timed = all("time_us" in e for e in events[:1]) and bool(events)
    t0 = float(events[0].get("time_us", 0)) if timed else 0.0
    for i, e in enumerate(events):
        action = e.get("action")
        t = (float(e.get("time_us", t0)) - t0) / 1e6 if timed else float(i)
        size = int(e.get("size", 0))
        if action == "alloc":
            frames = e.get("frames") or ()
            # torch shares one dict per distinct frame between events: a stack is its ids
            key = tuple(map(id, frames))
            known = by_frames.get(key)
            if known is None:
                line = source_line(frames)
                known = (lines.setdefault(line, len(lines)), phase_of(frames))
                by_frames[key] = known
            group = _BY_NAME.get(e.get("phase", ""), known[1])
            k = live[int(e.get("addr", 0))] = len(a_size)
            a_start.append(t)
            a_end.append(np.nan)
            a_size.append(size)
            a_group.append(group)
            a_line.append(known[0])
            if "shape" in e:
                a_shape[k] = str(e["shape"])
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
            ooms.append((t, size, int(e.get("device_free", 0))))
            continue
        else:
            continue
        times.append(t)
        rel.append(total)
        groups.append(group)
        deltas.append(delta)
        owner.append(k)
        reserved.append(res)
    segments = [s for s in data.get("segments", ()) if s.get("device", device) == device]
    live_end = {a: size for a, size, active in blocks_of(segments) if active}
    untraced = sum(size for addr, size in live_end.items() if addr not in live)
    before = unmatched + untraced
    reserved_end = sum(int(s.get("total_size", 0)) for s in segments)
    return device, Trace(
        times=np.asarray(times, dtype=np.float64),
        totals=np.asarray(rel, dtype=np.int64) + before,
        groups=np.asarray(groups, dtype=np.int8),
        deltas=np.asarray(deltas, dtype=np.int64),
        owner=np.asarray(owner, dtype=np.int64),
        reserved=np.asarray(reserved, dtype=np.int64) + (reserved_end - res),
        a_start=np.asarray(a_start, dtype=np.float64),
        a_end=np.asarray(a_end, dtype=np.float64),
        a_size=np.asarray(a_size, dtype=np.int64),
        a_group=np.asarray(a_group, dtype=np.int8),
        a_line=np.asarray(a_line, dtype=np.int32),
        a_shape=a_shape,
        lines=tuple(lines),
        before=before,
        timed=timed,
        ooms=tuple(ooms),
    )


def blocks_of(segments: Sequence[Mapping[str, Any]]) -> list[tuple[int, int, bool]]:
    """(address, size, active) of every block; a block without an address (a compacted file)
    lies after the blocks before it in its segment, as the allocator lists them."""
    out = []
    for s in segments:
        at = int(s.get("address", 0))
        for b in s.get("blocks", ()):
            size = int(b["size"])
            out.append((int(b.get("address", at)), size, str(b.get("state", "")).startswith("act")))
            at += size
    return out


def reduce(values: Ints, limit: int) -> npt.NDArray[np.intp]:
    """Indices of at most ``limit`` points of ``values`` that keep its shape: the lowest and the
    highest of each of ``limit // 2`` equal runs, in order, and the last. The peak survives."""
    n = len(values)
    if n <= limit:
        return np.arange(n)
    buckets = max(1, limit // 2 - 1)
    width = -(-n // buckets)
    padded = np.concatenate([values, np.full(width * buckets - n, values[-1])])
    runs = padded.reshape(buckets, width)
    base = np.arange(buckets) * width
    keep = np.concatenate([base + runs.argmin(axis=1), base + runs.argmax(axis=1), [n - 1]])
    return np.unique(np.minimum(keep, n - 1))
