"""A snapshot whose sizes no allocator writes (infinite, beyond 64 bits) is refused by the
values' own check, at the user's line: the message says what is wrong and what to pass, and the
traceback holds no frame of memlab's (a bug of memlab's keeps them: test_hostile_round6)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from test_hostile_round6 import memlab_frames

import memlab


def _segment(size: Any) -> dict[str, Any]:
    return {
        "device": 0,
        "address": 0,
        "total_size": size,
        "blocks": [{"size": size, "state": "active_allocated"}],
    }


def _refused(tmp_path: Path, snapshot: dict[str, Any]) -> str:
    """What memlab says, refusing ``snapshot`` written as a file: its message, once the test
    made sure the traceback holds no frame of memlab's."""
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    with pytest.raises(memlab.snapshot.SnapshotError) as info:
        memlab.load_snapshot(path)
    assert memlab_frames(info.value) == []
    return str(info.value)


@pytest.mark.parametrize(
    ("size", "shown"),
    [
        (float("inf"), "is inf"),
        (10**30, "is a number of 100 bits"),
        (10**5000, "is a number of 16,610 bits"),
    ],
    ids=["inf", "10**30", "10**5000"],
)
def test_a_size_beyond_any_device_is_refused_without_memlabs_frames(
    tmp_path: Path, size: Any, shown: str
) -> None:
    said = _refused(tmp_path, {"segments": [_segment(size)]})
    assert "is not laid out as a memory snapshot" in said and "OverflowError" in said
    assert f"a segment's total_size {shown}" in said and "_dump_snapshot" in said


def test_the_largest_size_torch_writes_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    big = 80 * 2**30  # an H100's memory in one segment
    path.write_bytes(pickle.dumps({"segments": [_segment(big)]}))
    snap = memlab.load_snapshot(path)
    assert snap.report.allocated_after == big


NOT_NUMBERS = [([[1, [2]]], "a list"), (None, "None"), ("many", "the text 'many'")]


@pytest.mark.parametrize(("size", "shown"), [*NOT_NUMBERS, (float("nan"), "nan")])
def test_a_size_that_is_no_number_is_refused_without_memlabs_frames(
    tmp_path: Path, size: Any, shown: str
) -> None:
    said = _refused(tmp_path, {"segments": [_segment(size)]})
    assert "is not laid out as a memory snapshot" in said and "_dump_snapshot" in said
    assert f"a segment's total_size is {shown}, not a number of bytes" in said


@pytest.mark.parametrize(("size", "shown"), [*NOT_NUMBERS, (float("inf"), "inf")])
def test_an_events_size_that_is_no_number_is_refused_without_memlabs_frames(
    tmp_path: Path, size: Any, shown: str
) -> None:
    event = {"action": "alloc", "addr": 0, "size": size, "stream": 0, "time_us": 1, "frames": []}
    said = _refused(tmp_path, {"segments": [_segment(512)], "device_traces": [[event]]})
    assert f"an event's size is {shown}, not a number of bytes" in said
    assert "is not laid out as a memory snapshot" in said


def test_a_size_written_as_digits_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [_segment("4096")]}))
    assert memlab.load_snapshot(path).report.allocated_after == 4096
