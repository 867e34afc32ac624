"""What in a snapshot is not as torch writes it, found after the reading failed.

The readers (`memlab.snapshot.load`, `memlab.snapshot.collect`) read a snapshot's fields
without checking each one first: a million blocks and events are read in one pass. Where the
reading raises, these functions look at the data for a field torch never writes so (a segment
that is no dict, a block without a size, a device named by a word, frames that are no list of
frames, an event's address that is text). A fault found is the file's, said in the reader's
words at the user's line; none found, the error was memlab's own and keeps its frames, to be
reported."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

from memlab.snapshot.limits import _PASS, _shown
from memlab.snapshot.unpickle import SnapshotError

#: What reading a field that is not as torch writes it raises (`int("x")`, ``None["size"]``, a
#: list where a name goes, a value nested past Python's recursion limit).
LAYOUT_ERRORS = (
    TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, RecursionError,
)  # fmt: skip

#: The first item of a list of frames already read: ``[READ, Known]`` (`memlab.snapshot.stream`
#: reads each list once, in place, before the collector takes its events).
READ = object()


def segments_fault(segments: Any) -> str | None:
    """The first thing in ``segments`` (the snapshot's list of segments) that is not as torch
    writes it, or None."""
    if not isinstance(segments, (list, tuple)):
        return f"its segments are {_shown(segments)}, not a list of segments"
    for i, s in enumerate(segments):
        if not isinstance(s, Mapping):
            return f"segment {i} is {_shown(s)}, not a dict"
        for key in ("device", "address"):
            if key in s and not _integer(s[key]):
                return f"segment {i}'s {key} is {_shown(s[key])}, not a whole number"
        blocks = s.get("blocks", ())
        if not isinstance(blocks, (list, tuple)):
            return f"segment {i}'s blocks are {_shown(blocks)}, not a list of blocks"
        for j, b in enumerate(blocks):
            where = f"block {j} of segment {i}"
            if not isinstance(b, Mapping):
                return f"{where} is {_shown(b)}, not a dict"
            if "size" not in b:
                return f"{where} has no size"
            if "address" in b and not _integer(b["address"]):
                return f"{where}'s address is {_shown(b['address'])}, not a whole number"
            wrong = frames_fault(b.get("frames"))
            if wrong is not None:
                return f"{where}'s frames {wrong}"
    return None


def frames_fault(frames: Any) -> str | None:
    """What is wrong with ``frames`` (a block's or an event's list of frames: dicts with a
    filename, a line and a name), said after "its frames", or None."""
    if frames is None or (isinstance(frames, list) and frames and frames[0] is READ):
        return None  # (none, or read already: sound when it was read)
    if not isinstance(frames, (list, tuple)):
        return f"are {_shown(frames)}, not a list of frames"
    for k, f in enumerate(frames):
        if not isinstance(f, Mapping):
            return f"hold {_shown(f)} at {k}, where a frame (a dict) goes"
    return None


def event_fault(event: Any) -> str | None:
    """The first field of ``event`` (one entry of a device's trace) that is not as torch
    writes it, or None."""
    if not isinstance(event, Mapping):
        return f"an event is {_shown(event)}, not a dict"
    time = event.get("time_us", 0)
    if not (_reads(float, time) and math.isfinite(float(time))):
        return f"an event's time_us is {_shown(time)}, not a number of microseconds"
    for key in ("addr", "device_free"):
        if key in event and not _integer(event[key]):
            return f"an event's {key} is {_shown(event[key])}, not a whole number"
    action = event.get("action")
    if action is not None and not isinstance(action, str):
        return f"an event's action is {_shown(action)}, not a name"
    phase = event.get("phase", "")
    if not isinstance(phase, str):
        return f"an event's phase is {_shown(phase)}, not a name"
    wrong = frames_fault(event.get("frames"))
    if wrong is not None:
        return f"an event's frames {wrong}"
    return None


def refuse_event(event: Any) -> None:
    """Raises the `SnapshotError` that says what is wrong with ``event``, where a field is not
    as torch writes it (called where reading it raised); returns where none is (the error was
    memlab's own: the caller raises it again, its frames kept)."""
    fault = event_fault(event)
    if fault is None and isinstance(sys.exc_info()[1], RecursionError):
        fault = "an event holds a value nested deeper than Python reads"
    if fault is not None:
        raise SnapshotError(
            f"the snapshot is not laid out as a memory snapshot ({fault}): {_PASS}"
        ) from None


def _integer(v: Any) -> bool:
    """Whether the readers can take ``v`` as a whole number, as they do (``int(v)``)."""
    return _reads(int, v)


def _reads(kind: type, v: Any) -> bool:
    try:
        kind(v)
    except (TypeError, ValueError, OverflowError):
        return False
    return True
