"""Reading a big snapshot in bounded memory: its events are taken out of the pickle while it is
read, so the file never stands in memory whole, and the cache's state is shown before the trace.

A snapshot is one pickle: ``segments`` (the cache's state at the end), then ``device_traces``,
one dict an event, each with a list of frames. `SafeUnpickler` (pickle's C loader) reads the
file through a `Tap` (`memlab.snapshot.tap`, which also keeps the memory taken bounded), which
every ``every`` bytes calls a `_Drain`: it hands the events loaded so far to their `Collector`,
empties the lists that held them, and gives the loader a memo (its table of what a later part of
the pickle may refer to again) without them (`memlab.snapshot.memo`). Forgotten: every event
dict (torch makes a new one for each event and never refers to it again), and a list of frames
once the allocation it belongs to is freed (torch shares one list between the events of an
allocation; a list also named by a segment's event is kept, for a later ``segment_free``). Kept
lists are replaced by their reading, ``[READ, Known]``. What stays is the compact arrays, the
lists of the allocations still live, the segments and the distinct frames. Should a file refer
again to a list forgotten (no torch file seen does), it is read again forgetting nothing
(``prune_frames=False``).

First view: when the first list of events is found, the segments before it are whole, and
``on_segments`` is called with them. ``progress(bytes_read, file_bytes)`` is called at each
drain; returning False stops the reading there (the events so far are kept).
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable
from typing import Any, cast

from memlab.core.collector import hold_collector
from memlab.snapshot.collect import Collector, Frames
from memlab.snapshot.faults import LAYOUT_ERRORS, READ, refuse_event
from memlab.snapshot.limits import MAX_DEVICES, check_counts
from memlab.snapshot.memo import replace_memo
from memlab.snapshot.tap import Tap
from memlab.snapshot.unpickle import SafeUnpickler, SnapshotError, check_path, read_to_the_end

#: Events are taken out of the loader every this many bytes of pickle.
EVERY = 2 * 2**20
#: Bytes of pickle read between two walks of the loader's memo, per entry the last walk saw:
#: a memo entry takes 2 bytes of pickle or more, so the walks cost less than the reading.
LOOK_BYTES = 16
_SEGMENT_ACTIONS = frozenset(("segment_alloc", "segment_map", "segment_free", "segment_unmap"))
Progress = Callable[[int, int], object]
OnSegments = Callable[[list[dict[str, Any]]], object]


class _StopError(Exception):
    """Raised inside the loader when ``progress`` returns False."""


class _CallbackError(Exception):
    """An error raised by the caller's ``on_segments`` or ``progress``: passed on as it is."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _call(f: Callable[..., object], *args: Any) -> object:
    try:
        return f(*args)
    except Exception as e:
        raise _CallbackError(e) from e


class _Drain:
    """Takes the events out of the loader: see the module's docstring."""

    def __init__(self, loader: SafeUnpickler, prune_frames: bool = True) -> None:
        self.loader = loader
        self.tap: Tap | None = None
        self.every = EVERY
        self.next_forget = 0  # bytes read when the loader's memo is next made to forget
        self.next_look = 0  # bytes read when the memo may next be looked through
        self.walked = self.kept = 0  # memo entries walked in all; kept at the last forgetting
        self.first_trace = -1  # memo index of the first list of events
        self.frames = Frames()
        self.traces: dict[int, tuple[list[Any], Collector]] = {}  # id(list) -> list, collector
        self.prune_frames = prune_frames
        self.by_addr: dict[int, list[Any]] = {}  # lists of frames of a live allocation's events
        self.drop: list[Any] = []  # lists of frames of freed allocations: forgotten at the swap
        self.pinned: dict[int, Any] = {}  # lists of frames named by segment events: kept
        self.dropped = self.forgot = 0  # lists of frames forgotten; forgettings
        self.segments: list[dict[str, Any]] | None = None  # whole once a trace is found
        self.segment_list: list[Any] | None = None  # the first list of segments, while read
        self.segments_checked = 0  # its length when last counted
        self.on_segments: OnSegments | None = None
        self.progress: Callable[[], object] | None = None

    def __call__(self) -> None:
        read = self.tap.read_bytes if self.tap is not None else 0
        if not self._take() and read >= self.next_look:  # nothing new: look for new lists
            work = self._look(self._memo())
            self._take()
            # a look walks the loader's whole memo: the next waits until the file has given
            # LOOK_BYTES bytes an item walked, so that the walking grows with the file alone
            self.next_look = read + LOOK_BYTES * work
        if self.prune_frames and self.first_trace >= 0 and read >= self.next_forget:
            memo = self._memo()  # (nothing to forget before the first events are taken)
            self._forget(memo)
            # each forgetting costs a pass over the loader's whole table (every index ever
            # given): spaced by an eighth of what was read, within 8 and 64 drains, and by
            # LOOK_BYTES an entry kept (a file whose memo forgets little)
            spacing = min(max(read // 8, 8 * self.every), 64 * self.every)
            self.next_forget = read + max(spacing, LOOK_BYTES * self.kept)
        if self.progress is not None and _call(self.progress) is False:
            raise _StopError

    def _memo(self) -> dict[int, Any]:
        # typeshed calls the memo dict[int, tuple[int, Any]]; the C loader's holds the objects
        memo = cast(dict[int, Any], self.loader.memo.copy())
        self.walked += len(memo)  # (what the reading cost in walks: tests bound it)
        return memo

    def _look(self, memo: dict[int, Any]) -> int:
        """New lists of events; the segments, when the first is found. The first list of
        segments is counted as it grows (`check_counts`), not after the file is read. Returns
        the memo's entries walked."""
        first, work = None, len(memo)
        for index, obj in memo.items():
            if type(obj) is not list or not obj or type(obj[0]) is not dict:
                continue
            if "action" in obj[0] and id(obj) not in self.traces:
                if len(self.traces) >= MAX_DEVICES:
                    raise _too_many_traces(self.loader.name)
                self.traces[id(obj)] = (obj, Collector(self.frames))
                first = index if first is None else first
            elif self.segment_list is None and _is_segment(obj[0]):
                self.segment_list = obj  # (torch writes its segments first)
        listed = self.segment_list
        if listed is not None and len(listed) != self.segments_checked:  # (still growing)
            self.segments_checked = len(listed)
            check_counts(listed, self.loader.name)  # (one pass, of MAX_SEGMENTS at most)
        if first is not None and self.first_trace < 0:
            self.first_trace = first
        if first is not None and self.segments is None:
            self.segments = [
                o for i, o in memo.items() if i < first and type(o) is dict and _is_segment(o)
            ]
            if self.on_segments is not None:
                _call(self.on_segments, self.segments)
        return work

    def _take(self) -> int:
        """Events out of the known lists into their collectors; how many."""
        taken = 0
        frames_of, prune, by_addr = self.frames.of, self.prune_frames, self.by_addr
        for events, collector in self.traces.values():
            batch = events[:]
            events.clear()
            taken += len(batch)
            for e in batch:  # each list of frames read once, here; the collector finds it read
                try:  # (no cost where nothing raises)
                    frames = e.get("frames")
                    if type(frames) is not list:
                        continue
                    if not (frames and frames[0] is READ):
                        frames[:] = [READ, frames_of(frames)]
                    if not prune:
                        continue
                    action = e.get("action")
                    if action in _SEGMENT_ACTIONS:
                        self.pinned[id(frames)] = frames
                        continue
                    addr = e.get("addr")
                    if action == "free_completed":
                        self.drop.append(frames)
                        self.drop += by_addr.pop(addr, ())
                        continue
                    mine = by_addr.get(addr)
                    if mine is None:
                        by_addr[addr] = [frames]
                    elif mine[-1] is not frames:
                        mine.append(frames)
                except LAYOUT_ERRORS:
                    refuse_event(e)  # (a field of the file's at fault: said at the user's line)
                    raise  # (memlab's own error: its frames kept, to be reported)
            collector.add(batch)
            for e in batch:
                e.clear()  # the memo holds it until forgotten: an empty dict meanwhile
        return taken

    def _forget(self, memo: dict[int, Any]) -> None:
        """The loader's memo without the events taken (emptied dicts after the first list of
        events) and the lists of frames of freed allocations."""
        drop = {id(f) for f in self.drop if id(f) not in self.pinned}
        first = self.first_trace if self.first_trace >= 0 else len(memo) + 2**62
        keep = {}
        for index, obj in memo.items():
            kind = type(obj)
            if kind is dict and ((not obj and index > first) or "action" in obj):
                continue
            if kind is list and id(obj) in drop:
                self.dropped += 1
                continue
            keep[index] = obj
        self.kept = len(keep)
        if len(keep) < len(memo):
            replace_memo(self.loader, keep)
            self.forgot += 1
        self.drop.clear()


def _is_segment(obj: dict[str, Any]) -> bool:
    return "total_size" in obj and "blocks" in obj


def _too_many_traces(name: str) -> SnapshotError:
    return SnapshotError(
        f"{name} holds more than {MAX_DEVICES} lists of events, and a memory snapshot has one a "
        f"device (torch numbers {MAX_DEVICES} at most): pass a file written by "
        "torch.cuda.memory._dump_snapshot."
    )


def stream(
    path: str | os.PathLike[str],
    every: int | None = None,
    on_segments: OnSegments | None = None,
    progress: Progress | None = None,
    prune_frames: bool = True,
) -> tuple[dict[str, Any], dict[int, Collector], Frames]:
    """The snapshot in ``path`` with its ``device_traces`` emptied, each device's `Collector`
    (holding its events), and the stacks read (`Frames`: the segments' blocks may hold read
    ones, ``[READ, Known]``); in bounded memory. ``every``: bytes between drains (`EVERY`).
    If ``progress`` stopped the reading, the dict has the segments, the lists of events (emptied)
    and ``"cancelled_at"`` (the bytes of pickle read)."""
    p = check_path(path)
    with p.open("rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        size = p.stat().st_size
        tap = Tap(gzip.GzipFile(fileobj=raw) if gzipped else raw, every or EVERY, str(p), size)
        loader = SafeUnpickler(tap, str(p))
        drain = _Drain(loader, prune_frames)
        drain.tap, drain.every = tap, every or EVERY
        drain.on_segments = on_segments
        if progress is not None:
            drain.progress = lambda: progress(raw.tell(), size)  # compressed bytes if gzipped
        tap.hook = drain
        failed = None
        release = hold_collector()
        try:
            data = loader.load()
            tap.hook = None
            read_to_the_end(tap.raw, p)  # (a gzip's check comes after the pickle's end)
            if drain.segments is None and on_segments is not None and isinstance(data, dict):
                # no trace, or too small a file for a drain
                _call(on_segments, data.get("segments") or [])
            traces = data.get("device_traces") if isinstance(data, dict) else None
            if type(traces) is list and len(traces) > MAX_DEVICES:
                raise _too_many_traces(str(p))
            for t in traces if type(traces) is list else ():
                if type(t) is list and id(t) not in drain.traces:  # too short to be seen yet
                    drain.traces[id(t)] = (t, Collector(drain.frames))
            drain._take()  # the events after the last hook
        except _StopError:
            data = {"segments": drain.segments or [], "cancelled_at": tap.read_bytes}
            data["device_traces"] = [t for t, _ in drain.traces.values()]
        except _CallbackError as e:
            failed = e.error  # raised below, outside this handler: with no context of memlab's
        except SnapshotError:
            raise
        except Exception as e:
            if drain.forgot:  # what was forgotten was referred to again: keep all
                tap.hook = None
                again = on_segments if drain.segments is None else None  # not shown twice
                del loader, drain
                return stream(path, every, again, progress, prune_frames=False)
            raise SnapshotError(
                f"{p} is not a readable pickle of a snapshot ({type(e).__name__}: {e}): pass a "
                "file written by torch.cuda.memory._dump_snapshot."
            ) from e
        finally:
            tap.hook = None
            release()
    if failed is not None:
        raise failed
    if not isinstance(data, dict) or "segments" not in data:
        raise SnapshotError(
            f"{p} holds a {type(data).__name__} without 'segments', not a memory snapshot: pass "
            "a file written by torch.cuda.memory._dump_snapshot."
        )
    traces = data.get("device_traces") or []
    odd = [t for t in (traces if type(traces) is list else [traces]) if type(t) is not list]
    if odd:
        kind = type(odd[0]).__name__
        raise SnapshotError(
            f"{p} is not laid out as a memory snapshot (device_traces "
            f"{'holds' if type(traces) is list else 'is'} {'an' if kind[0] in 'aeiou' else 'a'} "
            f"{kind}, not a list of events per device): pass a file written by "
            "torch.cuda.memory._dump_snapshot."
        )
    return data, {i: drain.traces[id(t)][1] for i, t in enumerate(traces)}, drain.frames
