"""Reading a big snapshot in bounded memory: its events are taken out of the pickle while it is
read, so the file never stands in memory whole.

A snapshot is one pickle; most of it is ``device_traces``, one dict an event, each with a list of
frames. `SafeUnpickler` (pickle's C loader) reads the file through `_Tap`, which every
``every`` bytes hands the events loaded so far to their `Collector` and empties the lists that
held them. The loader's memo (the table of objects a later part of the pickle may refer to
again) still holds each event dict and each list of frames, and entries cannot be taken out of
it, so each is shrunk where it stands: the event dict emptied (torch makes a new dict for each
event and never refers to it again), the list of frames replaced by its reading, ``[READ,
Known]`` (torch shares one list between the events of an allocation, so a later event may refer
to it; `Frames.of` knows the form). What stays is about 150 bytes an event, the segments, the
distinct frames and the collectors' arrays.

The memo is copied (it can only be read whole) to find the lists of events: until one is found,
and again when the known ones stop growing (the next device's list has begun).
"""

from __future__ import annotations

import gc
import gzip
from pathlib import Path
from typing import Any, cast

from memlab.snapshot.collect import READ, Collector, Frames
from memlab.snapshot.unpickle import SafeUnpickler, SnapshotError, check_path

#: Events are taken out of the loader every this many bytes of pickle.
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

    def __init__(self, loader: SafeUnpickler) -> None:
        self.loader = loader
        self.frames = Frames()
        self.traces: dict[int, tuple[list[Any], Collector]] = {}  # id(list) -> list, collector
        self.looked = 0  # the memo's entries before this index have been looked through

    def __call__(self) -> None:
        if not self._take():  # nothing new in the lists known: look for new ones
            self._look()
            self._take()

    def _look(self) -> None:
        # typeshed calls the memo dict[int, tuple[int, Any]]; the C loader's holds the objects
        memo = cast(dict[int, Any], self.loader.memo.copy())
        for index in range(self.looked, len(memo)):
            obj = memo.get(index)
            if type(obj) is list and obj and id(obj) not in self.traces and _is_trace(obj):
                self.traces[id(obj)] = (obj, Collector(self.frames))
        self.looked = len(memo)

    def _take(self) -> int:
        """Events out of the known lists into their collectors; how many."""
        taken = 0
        frames_of = self.frames.of
        for events, collector in self.traces.values():
            batch = events[:]
            events.clear()
            collector.add(batch)
            taken += len(batch)
            for e in batch:
                frames = e.get("frames")
                if type(frames) is list and not (frames and frames[0] is READ):
                    frames[:] = [READ, frames_of(frames)]
                e.clear()
        return taken


def _is_trace(obj: list[Any]) -> bool:
    return type(obj[0]) is dict and "action" in obj[0]


def stream(
    path: str | Path, every: int = EVERY
) -> tuple[dict[str, Any], dict[int, Collector], Frames]:
    """The snapshot in ``path`` with its ``device_traces`` emptied, each device's `Collector`
    (holding its events), and the stacks read (`Frames`: the segments' blocks may hold read
    ones, ``[READ, Known]``); in bounded memory."""
    p = check_path(path)
    with p.open("rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        tap = _Tap(gzip.GzipFile(fileobj=raw) if gzipped else raw, every)
        loader = SafeUnpickler(tap, str(p))
        drain = _Drain(loader)
        tap.hook = drain
        collecting = gc.isenabled()
        gc.disable()
        try:
            data = loader.load()
            for t in data.get("device_traces") or [] if isinstance(data, dict) else []:
                if type(t) is list and id(t) not in drain.traces:  # too short to be seen yet
                    drain.traces[id(t)] = (t, Collector(drain.frames))
            drain._take()  # the events after the last hook
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
    traces = data.get("device_traces") or []
    return data, {i: drain.traces[id(t)][1] for i, t in enumerate(traces)}, drain.frames
