"""A snapshot's events as compact arrays: what was allocated when, by whom, and the live total.

The raw snapshot (dicts per event) is read once by `parse` and left behind; what remains is
numpy arrays, one entry an event or an allocation, and a table of source lines. Allocations are
grouped by the phase of the program that made them (forward, backward, optimizer, other), read
from their stack frames, or from the ``phase`` key memlab writes; memory live before the trace
began is its own group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from memlab.snapshot.unpickle import SnapshotError

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

    def by_group(self, at: npt.NDArray[np.intp] | None = None) -> npt.NDArray[np.int64]:
        """Live bytes by group after each event (or after the events ``at``):
        ``[len(GROUPS), len(times)]``. One group at a time, so that a long trace needs memory
        for two of its arrays more, not for ten."""
        n = len(self.deltas) if at is None else len(at)
        out = np.zeros((len(GROUPS), n), dtype=np.int64)
        for g in range(len(GROUPS)):
            running = np.cumsum(np.where(self.groups == g, self.deltas, 0))
            out[g] = running if at is None else running[at]
            del running
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


def choose(device: int | None, counts: Sequence[int]) -> int:
    """The device asked for, checked against the snapshot's, or the one with most events."""
    if device is None:
        return max(range(len(counts)), key=counts.__getitem__, default=0)
    if not isinstance(device, int) or isinstance(device, bool):
        raise ValueError(
            f"device={device!r} is a {type(device).__name__}: pass a CUDA device's index (an "
            "int), or None for the busiest."
        )
    if device < 0 or (counts and device >= len(counts)):
        raise ValueError(
            f"device={device!r}: the snapshot has traces for devices 0 to {len(counts) - 1}; "
            "pass one of those, or None for the busiest."
        )
    return device


def busiest(data: Mapping[str, Any], device: int | None) -> tuple[int, list[Any]]:
    """The device asked for (else the one with most events; where no trace has any, the one
    whose segments reserve the most) and its trace's events."""
    traces = data.get("device_traces") or []
    if not isinstance(traces, (list, tuple)) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError(
            f"device_traces is {type(traces).__name__} {traces!r:.40}: a snapshot's is a list "
            "of each device's list of events (torch.cuda.memory._snapshot() writes it)."
        )
    counts = [len(t) for t in traces]
    if device is None and not any(counts):
        device = reserving_most(data.get("segments") or ())
        if device is not None:
            return device, list(traces[device]) if device < len(traces) else []
    device = choose(device, counts)
    return device, list(traces[device]) if traces else []


def reserving_most(segments: Any) -> int | None:
    """The device whose segments reserve the most (the one to show where no trace has an
    event); None where no segment says."""
    reserved: dict[int, int] = {}
    for seg in segments:
        if isinstance(seg, Mapping):
            d = int(seg.get("device", 0))
            reserved[d] = reserved.get(d, 0) + int(seg.get("total_size", 0))
    return max(reserved, key=reserved.__getitem__) if reserved else None


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
