"""Reading a big snapshot in bounded memory: its events are taken out of the pickle while it is
read, so the file never stands in memory whole.

A snapshot is one pickle; most of it is ``device_traces``, one dict an event, each with a list of
frames. `SafeUnpickler` (pickle's C loader) reads the file through `_Tap`, which every
``every`` bytes hands the events loaded so far to their `Collector` and empties the lists that
held them. The loader's memo (the table of objects a later part of the pickle can refer to)
would still hold every event, so each time each event dict's entry is set to None (torch makes
a new dict for each event, never referred to again; the entry stays, as the loader numbers new
entries by their count), each list of frames's entry to its `Known` reading (torch shares a list
between the events of one allocation, so later events may refer to it) and each string to its
interned copy. What stays is the segments, the distinct frames, one small entry per event in
the memo, and the collectors' arrays.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import io
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from memlab.snapshot.collect import Collector, Frames, Known
from memlab.snapshot.unpickle import SafeUnpickler, SnapshotError, check_path

#: Events are taken out of the loader every this many bytes of pickle at least (and at least
#: every 8 bytes per entry of its memo, which each drain copies).
EVERY = 16 * 2**20


class _Tap:
    """A file that calls ``hook`` after every ``every`` bytes read."""

    def __init__(self, raw: Any, every: int) -> None:
        self.raw, self.every, self.next = raw, every, every
        self.read_bytes = 0
        self.hook: Any = None

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.raw.read(n)
        self.read_bytes += len(data)
        if self.read_bytes >= self.next and self.hook is not None:
            self.next = self.read_bytes + self.every
            self.hook()
        return data

    def readinto(self, b: Any) -> int:
        n: int = self.raw.readinto(b)
        self.read_bytes += n
        return n

    def readline(self) -> bytes:
        line: bytes = self.raw.readline()
        self.read_bytes += len(line)
        return line


class _Drain:
    """Takes the events out of the loader: see the module's docstring."""

    def __init__(self, loader: SafeUnpickler, tap: _Tap) -> None:
        self.loader, self.tap = loader, tap
        self.frames = Frames()
        self.traces: dict[int, tuple[list[Any], Collector]] = {}  # id(list) -> list, collector
        self.seen = 0  # the memo's entries before this index have been looked at

    def __call__(self) -> None:
        # typeshed calls the memo dict[int, tuple[int, Any]]; the C loader's holds the objects
        memo = cast(dict[int, Any], self.loader.memo.copy())
        for index in range(self.seen, len(memo)):
            obj = memo.get(index)
            if type(obj) is list and id(obj) not in self.traces and _is_trace(obj):
                self.traces[id(obj)] = (obj, Collector(self.frames))
        taken: dict[int, Any] = {}  # id -> event: alive until the memo is rewritten
        replaced: dict[int, Known] = {}
        for events, collector in self.traces.values():
            batch = events[:]
            events.clear()
            collector.add(batch)
            for e in batch:
                taken[id(e)] = e
                frames = e.get("frames")
                if type(frames) is list:
                    replaced[id(frames)] = self.frames.of(frames)
        changed: dict[int, Any] = {}
        for index, obj in memo.items():
            kind = type(obj)
            if kind is dict and id(obj) in taken:
                # None, not left out: the loader numbers each new entry by its count
                changed[index] = None
            elif kind is list and id(obj) in replaced:
                changed[index] = replaced[id(obj)]
            elif kind is str and index >= self.seen and sys.intern(obj) is not obj:
                changed[index] = sys.intern(obj)
        self.seen = len(memo)
        # each drain copies the whole memo: space them out as it grows (linear time in all)
        self.tap.every = max(self.tap.every, 8 * len(memo))
        if SET_MEMO is not None and changed:
            SET_MEMO(self.loader, memo, changed)


def _set_by_dict(loader: pickle.Unpickler, memo: dict[int, Any], changed: dict[int, Any]) -> None:
    memo.update(changed)
    loader.memo = cast(dict[int, tuple[int, Any]], memo)


def _set_by_failed_dict(
    loader: pickle.Unpickler, memo: dict[int, Any], changed: dict[int, Any]
) -> None:
    """CPython's C loader (3.11 to 3.14 at least) writes a dict's entries over its current memo
    and then replaces that memo with an empty one; the entries written stay when the assignment
    fails after them (a key that is not an int). So only the entries that change are written,
    and none is cleared: the loader's count of entries, which numbers the next one, stays
    right. `_setter` checks that this is what happens."""
    ending: dict[Any, Any] = changed
    ending["end"] = None
    with contextlib.suppress(TypeError):
        loader.memo = ending


def _setter() -> Callable[[pickle.Unpickler, dict[int, Any], dict[int, Any]], None] | None:
    """How to change entries of the loader's memo here, tried on a loader of its own: by
    assigning a dict where that works, else by `_set_by_failed_dict`; None if neither does (then
    the memo is left alone: the result is the same, only the memory is not bounded)."""
    for way in (_set_by_dict, _set_by_failed_dict):
        probe, marker = pickle.Unpickler(io.BytesIO(b"\x80\x04]\x94]\x94.")), object()
        probe.load()  # two lists in its memo
        try:
            way(probe, cast(dict[int, Any], probe.memo.copy()), {1: marker})
            memo = cast(dict[int, Any], probe.memo.copy())
        except Exception:  # any failure means: not this way
            continue
        if memo.get(1) is marker and memo.get(0) == [] and len(memo) == 2:
            return way
    return None


#: How this Python's loader takes a new memo (see `_setter`).
SET_MEMO = _setter()


def _is_trace(obj: list[Any]) -> bool:
    return bool(obj) and type(obj[0]) is dict and "action" in obj[0]


def stream(path: str | Path, every: int = EVERY) -> tuple[dict[str, Any], dict[int, Collector]]:
    """The snapshot in ``path`` with its ``device_traces`` emptied, and each device's
    `Collector` (holding its events); in bounded memory."""
    p = check_path(path)
    with p.open("rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        tap = _Tap(gzip.GzipFile(fileobj=raw) if gzipped else raw, every)
        loader = SafeUnpickler(tap, str(p))
        drain = _Drain(loader, tap)
        tap.hook = drain
        collecting = gc.isenabled()
        gc.disable()
        try:
            data = loader.load()
            for t in data.get("device_traces") or [] if isinstance(data, dict) else []:
                if type(t) is list and id(t) not in drain.traces:  # too short to be seen yet
                    drain.traces[id(t)] = (t, Collector(drain.frames))
            drain()  # the events after the last hook
        except SnapshotError:
            raise
        except Exception as e:
            raise SnapshotError(
                f"{p} is not a readable pickle of a snapshot ({type(e).__name__}: {e}): pass a "
                "file written by torch.cuda.memory._dump_snapshot."
            ) from e
        finally:
            tap.hook = None
            if collecting:
                gc.enable()
    if not isinstance(data, dict) or "segments" not in data:
        raise SnapshotError(
            f"{p} holds a {type(data).__name__} without 'segments', not a memory snapshot: pass "
            "a file written by torch.cuda.memory._dump_snapshot."
        )
    return data, {i: drain.traces[id(t)][1] for i, t in enumerate(data.get("device_traces") or [])}
