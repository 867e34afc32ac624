"""A snapshot whose fields are not laid out as torch writes them (a segment that is no dict, a
block without a size, a device named by a word, frames that are no list of frames, an event's
address or time as text) is refused at the user's line: the message names the field and what
to pass, and the traceback holds no frame of memlab's. Where the data is sound and the reading
still fails, the error is memlab's own and keeps its frames (test_hostile_round6), to be
reported. Each case is read from a file (the streaming reader) and from a dict."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from test_hostile_round6 import memlab_frames

import memlab
from memlab.snapshot import SnapshotError


def _block(**fields: Any) -> dict[str, Any]:
    return {"size": 512, "state": "active_allocated", **fields}


def _segment(*blocks: Any, **fields: Any) -> dict[str, Any]:
    return {"device": 0, "address": 0, "total_size": 512, "blocks": list(blocks), **fields}


def _event(**fields: Any) -> dict[str, Any]:
    event = {"action": "alloc", "addr": 0, "size": 512, "stream": 0, "time_us": 1, "frames": []}
    event.update(fields)
    return event


def _traced(*events: Any) -> dict[str, Any]:
    return {"segments": [_segment(_block())], "device_traces": [list(events)]}


FRAME = {"filename": "train.py", "line": 3, "name": "step"}

CASES = {
    "segments None": ({"segments": None}, "its segments are None, not a list of segments"),
    "a segment an int": ({"segments": [5]}, "segment 0 is an int, not a dict"),
    "blocks an int": ({"segments": [_segment()] * 2 + [{"blocks": 5}]}, "segment 2's blocks"),
    "a block an int": ({"segments": [_segment(_block(), 7)]}, "block 1 of segment 0 is an int"),
    "a block without a size": (
        {"segments": [_segment({"state": "active_allocated"})]},
        "block 0 of segment 0 has no size",
    ),
    "a device as text": (
        {"segments": [_segment(_block(), device="gpu")]},
        "a segment's device is the text 'gpu', not a device's index",
    ),
    "a block's frames an int": (
        {"segments": [_segment(_block(frames=5))]},
        "block 0 of segment 0's frames are an int, not a list of frames",
    ),
    "a block's frames of ints": (
        {"segments": [_segment(_block(frames=[FRAME, 5]))]},
        "frames hold an int at 1, where a frame (a dict) goes",
    ),
    "an event an int": (_traced(_event(), 5), "an event is an int, not a dict"),
    "an address as text": (_traced(_event(addr="x")), "an event's addr is the text 'x'"),
    "an address as a list": (_traced(_event(addr=[1])), "an event's addr is a list"),
    "a time as text": (_traced(_event(time_us="t")), "an event's time_us is the text 't'"),
    "an event's frames an int": (
        _traced(_event(frames=5)),
        "an event's frames are an int, not a list of frames",
    ),
    "an event's frames of text": (
        _traced(_event(frames=["train.py"])),
        "an event's frames hold the text 'train.py' at 0",
    ),
    "a phase as a list": (_traced(_event(phase=["fwd"])), "an event's phase is a list"),
}


@pytest.mark.parametrize("snapshot, said", CASES.values(), ids=list(CASES))
@pytest.mark.parametrize("read", ["file", "dict"])
def test_a_field_torch_never_writes_so_is_refused_without_memlabs_frames(
    tmp_path: Path, snapshot: dict[str, Any], said: str, read: str
) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    with pytest.raises(SnapshotError) as info:
        if read == "file":
            memlab.load_snapshot(path)
        else:
            memlab.snapshot.from_dict(snapshot, "mine")
    message = str(info.value)
    assert "is not laid out as a memory snapshot" in message, message
    assert said in message and "torch.cuda.memory._dump_snapshot" in message, message
    assert memlab_frames(info.value) == [], memlab_frames(info.value)


def test_a_block_without_a_size_is_refused_in_the_first_view_too(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [_segment({"state": "active_allocated"})]}))
    seen: list[Any] = []
    with pytest.raises(SnapshotError, match="block 0 of segment 0 has no size") as info:
        memlab.load_snapshot(path, first_view=seen.append)
    assert seen == [] and memlab_frames(info.value) == []


def test_sound_fields_written_as_torch_may_write_them_still_read(tmp_path: Path) -> None:
    """What the checks must not refuse: frames None, an address written as digits, a float
    time, a segment's blocks as a tuple."""
    snapshot = {
        "segments": [_segment(_block(frames=None), _block(address=512, frames=[FRAME]))],
        "device_traces": [[_event(addr="4096", time_us=2.5, frames=[FRAME])]],
    }
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    snap = memlab.load_snapshot(path)
    assert snap.events == 1 and snap.allocated == 1024
    assert memlab.snapshot.from_dict(snapshot, "mine").allocated == 1024


MORE = {
    "an action as a list": (_traced(_event(action=["alloc"])), "an event's action is a list"),
    "a size as '--5'": ({"segments": [_segment(_block(size="--5"))]}, "size is the text '--5'"),
    "a requested size as '²'": (
        {"segments": [_segment(_block(requested_size="²"))]},
        "requested_size is the text '²'",
    ),
    "a total size as '--5'": ({"segments": [_segment(total_size="--5")]}, "total_size is the"),
    "segments an int": ({"segments": 5, "device_traces": []}, "its segments are an int"),
}


@pytest.mark.parametrize("snapshot, said", MORE.values(), ids=list(MORE))
@pytest.mark.parametrize("read", ["file", "dict"])
def test_more_fields_torch_never_writes_so_are_refused_without_memlabs_frames(
    tmp_path: Path, snapshot: dict[str, Any], said: str, read: str
) -> None:
    test_a_field_torch_never_writes_so_is_refused_without_memlabs_frames(
        tmp_path, snapshot, said, read
    )


def test_blocks_given_as_a_generator_are_refused_not_used_up_unseen() -> None:
    segment = _segment()
    segment["blocks"] = (b for b in [_block()])
    with pytest.raises(SnapshotError, match=r"segment 0's blocks are a generator") as info:
        memlab.snapshot.from_dict({"segments": [segment]}, "mine")
    assert memlab_frames(info.value) == []


def test_a_value_nested_deeper_than_python_reads_is_refused() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    for snapshot in (
        {"segments": [_segment(_block(state=deep))]},
        _traced(_event(shape=deep)),
    ):
        with pytest.raises(SnapshotError, match="nested deeper than Python reads") as info:
            memlab.snapshot.from_dict(snapshot, "mine")
        assert memlab_frames(info.value) == []


def test_a_bug_of_memlabs_while_a_file_is_read_keeps_its_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream reads each list of frames in place before the collector takes the events: a
    list read so is sound, and an error of memlab's own afterwards is not put on the file."""
    from memlab.snapshot import collect

    class Broken(dict):  # type: ignore[type-arg]
        def get(self, *args: Any) -> Any:
            raise KeyError("memlab's own")

    monkeypatch.setattr(collect, "_BY_NAME", Broken())
    path = tmp_path / "snap.pickle"
    shared = [FRAME]  # (a block and an event share their frames, as torch writes them)
    snapshot = _traced(_event(frames=shared))
    snapshot["segments"] = [_segment(_block(frames=shared))]
    path.write_bytes(pickle.dumps(snapshot))
    with pytest.raises(SnapshotError) as info:
        memlab.load_snapshot(path)
    assert "frames" not in str(info.value) and "KeyError" in str(info.value), str(info.value)
    assert memlab_frames(info.value)  # to be reported
