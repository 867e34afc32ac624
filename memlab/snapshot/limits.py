"""What a memory snapshot can hold, checked before memlab reads it further: counts that a few
bytes of pickle can inflate (one block listed a million times through the pickle's memo), and
values no allocator writes (a negative size, a device index past what torch can number).

`check_counts` costs one pass over the segments, not over their blocks, so the reader of a file
(`memlab.snapshot.stream`) runs it on a list of segments while the file is still being read."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, NoReturn

from memlab.snapshot.unpickle import SnapshotError

#: Blocks read at most, all segments together. A real program's snapshot holds far fewer; a
#: pickle can list one block again and again in a few bytes (its memo), and millions of them
#: would take minutes and gigabytes to read.
MAX_BLOCKS = 1_000_000
#: Segments read at most: each is at least 2 MiB of a GPU (80 GiB: 40,960 of them).
MAX_SEGMENTS = 100_000
#: Devices a snapshot can name: torch numbers a device with an 8-bit index (0 to 127).
MAX_DEVICES = 128
_PASS = "pass a file written by torch.cuda.memory._dump_snapshot."


def check_counts(segments: Any, name: str) -> None:
    """A `SnapshotError` where ``segments`` are more than `MAX_SEGMENTS` or list more than
    `MAX_BLOCKS` blocks (counted without reading them)."""
    if not isinstance(segments, (list, tuple)):
        raise SnapshotError(
            f"{name} is not laid out as a memory snapshot (its segments are {_shown(segments)}, "
            f"not a list of segments): {_PASS}"
        )
    if len(segments) > MAX_SEGMENTS:
        raise SnapshotError(
            f"{name} lists {len(segments):,} segments, more than memlab reads ({MAX_SEGMENTS:,}; "
            f"a GPU of 80 GiB holds at most 40,960): {_PASS}"
        )
    n = 0
    for s in segments:
        blocks = s.get("blocks") if isinstance(s, Mapping) else None
        if isinstance(blocks, (list, tuple)):
            n += len(blocks)
    if n > MAX_BLOCKS:
        raise SnapshotError(
            f"{name} lists {n:,} blocks in {len(segments):,} segments, more than memlab reads "
            f"({MAX_BLOCKS:,}; a real program's snapshot holds far fewer): {_PASS}"
        )


def check_values(segments: Any, name: str) -> None:
    """A `SnapshotError` where a segment names an impossible device or a segment or block an
    impossible size (negative); values of the wrong type are left to the layout's own check."""
    if not isinstance(segments, (list, tuple)):
        return
    for i, s in enumerate(segments):
        if not isinstance(s, Mapping):
            continue
        device = s.get("device", 0)
        if not _number(device):
            raise SnapshotError(
                f"{name} is not laid out as a memory snapshot (a segment's device is "
                f"{_shown(device)}, not a device's index): {_PASS}"
            )
        if _whole(device) and not 0 <= device < MAX_DEVICES:
            raise SnapshotError(
                f"{name}: a segment is on device {device!r}, which no GPU is (torch numbers "
                f"devices 0 to {MAX_DEVICES - 1}): {_PASS}"
            )
        _check_size(s, "total_size", "a segment", name)
        blocks = s.get("blocks", ())
        if not isinstance(blocks, (list, tuple)):  # (a generator would be used up unseen)
            raise SnapshotError(
                f"{name} is not laid out as a memory snapshot (segment {i}'s blocks are "
                f"{_shown(blocks)}, not a list of blocks): {_PASS}"
            )
        for b in blocks:
            if isinstance(b, Mapping):
                _check_size(b, "size", "a block", name)
                _check_size(b, "requested_size", "a block", name)


def check_event_size(size: int) -> None:
    """A `SnapshotError` for an event of a negative size (the reader has no file name)."""
    if size < 0:
        raise SnapshotError(
            f"the snapshot is not laid out as a memory snapshot (an event's size is {size:,} "
            f"bytes; sizes are never negative): {_PASS}"
        )


def _check_size(d: Mapping[str, Any], key: str, what: str, name: str) -> None:
    size = d.get(key, 0)
    if not _number(size):  # (a list, None, a word: never a byte count)
        raise SnapshotError(
            f"{name} is not laid out as a memory snapshot ({what}'s {key} is {_shown(size)}, "
            f"not a number of bytes): {_PASS}"
        )
    if _whole(size) and size < 0:
        raise SnapshotError(
            f"{name}: {what}'s {key} is {size:,} bytes; sizes are never negative: {_PASS}"
        )
    if _whole(size) and size > MAX_SIZE:  # (inf; an int torch's allocator never writes)
        shown = "inf" if isinstance(size, float) else f"a number of {size.bit_length():,} bits"
        raise SnapshotError(
            f"{name} is not laid out as a memory snapshot ({what}'s {key} is {shown}, more "
            f"bytes than any device holds: an OverflowError where it is read as bytes): {_PASS}"
        )


#: More bytes than a size torch's allocator writes can be (a signed 64-bit count).
MAX_SIZE = 2**63 - 1


def event_size_refused(size: Any) -> NoReturn:
    """The `SnapshotError` for an event whose size is no number (the reader, which converts each
    event's size as it goes, calls this where the conversion fails)."""
    raise SnapshotError(
        f"the snapshot is not laid out as a memory snapshot (an event's size is {_shown(size)}, "
        f"not a number of bytes): {_PASS}"
    )


def _shown(v: Any) -> str:
    if v is None or isinstance(v, float):  # (nan, inf)
        return str(v)
    if isinstance(v, str):
        return f"the text {v[:40]!r}"
    kind = type(v).__name__
    return f"{'an' if kind[:1] in 'aeiouAEIOU' else 'a'} {kind}"


def _number(v: Any) -> bool:
    """A size the layout's reading can take as bytes: a number (not nan), or its digits."""
    if isinstance(v, str):  # (as the readers take it: "12" is, "--5" and "²" are not)
        try:
            int(v)
        except ValueError:
            return False
        return True
    return isinstance(v, numbers.Real) and v == v


def _whole(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # (nan: not)
