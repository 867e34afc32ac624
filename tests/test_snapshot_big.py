"""Big snapshots: the first view from the segments before the trace, progress that stops the
reading, and the loader's memo that forgets what nothing will refer to again, all against the
same file read whole (`memlab.snapshot.from_dict` on ``pickle.loads``) and against the figures
`memlab.snapshot.synthetic` knows."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_snapshot import Evil, dumped, same

from memlab.snapshot import SnapshotError, from_dict, load_snapshot, stream
from memlab.snapshot.synthetic import training_snapshot

SEGMENT_FIGURES = (
    "allocated",
    "reserved",
    "segments",
    "free_cache",
    "largest_free",
    "internal_free",
    "fragmentation",
    "live",
)


@pytest.fixture
def small_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drains every 4 KiB (pickle's C loader reads protocol 4 in frames of 64 KiB, so a drain
    comes every 64 KiB: a file of 300 steps, about 1 MiB, sees 15)."""
    monkeypatch.setattr(stream, "EVERY", 4096)


def test_the_first_view_comes_before_the_trace_with_the_final_figures(
    tmp_path: Path, small_drains: None
) -> None:
    data, truth = training_snapshot(steps=300)
    path = dumped(tmp_path, data)
    order: list[Any] = []
    s = load_snapshot(
        path, first_view=lambda v: order.append(v), progress=lambda n, of: order.append((n, of))
    )
    views = [o for o in order if not isinstance(o, tuple)]
    assert len(views) == 1
    view, at = views[0], order.index(views[0])
    drains = [o for o in order if isinstance(o, tuple)]
    # shown at the first drain that finds the trace, long before the file was read
    assert at <= 2 and len(drains) > 10 and drains[-1][0] <= drains[-1][1] == path.stat().st_size
    for name in SEGMENT_FIGURES:
        assert getattr(view, name) == getattr(s, name), name
    whole = from_dict(pickle.loads(path.read_bytes()), "whole")
    assert (view.allocated, view.reserved) == (whole.allocated, truth.reserved)
    assert view.allocated == truth.end and view.events == 0 and s.events == truth.events
    assert "first view" in view.text() and s.peak == truth.peak
    view.to_dict()  # JSON-safe, without a trace


def test_a_small_file_still_gets_its_first_view(tmp_path: Path) -> None:
    data, truth = training_snapshot(steps=3)
    views: list[Any] = []
    s = load_snapshot(dumped(tmp_path, data), first_view=views.append)  # one read, no drain
    assert len(views) == 1 and views[0].allocated == s.allocated == truth.end


def test_progress_returning_false_stops_with_the_events_read(
    tmp_path: Path, small_drains: None
) -> None:
    data, truth = training_snapshot(steps=300)
    path = dumped(tmp_path, data)
    calls: list[int] = []

    def progress(read: int, of: int) -> bool:
        calls.append(read)
        return len(calls) < 4

    s = load_snapshot(path, progress=progress)
    whole = from_dict(pickle.loads(path.read_bytes()), "whole")
    assert len(calls) == 4 and 0 < s.events < truth.events
    n = len(s.trace.deltas)
    assert n > 0 and np.array_equal(s.trace.deltas, whole.trace.deltas[:n])  # a prefix
    assert np.array_equal(s.trace.a_size, whole.trace.a_size[: len(s.trace.a_size)])
    assert s.allocated == whole.allocated and s.reserved == whole.reserved
    assert any("cancelled at" in n for n in s.notes)


def test_bad_callbacks_are_named() -> None:
    with pytest.raises(TypeError, match=r"first_view=3 is a int: pass a function"):
        load_snapshot("x.pickle", first_view=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"progress='yes' is a str: pass a function"):
        load_snapshot("x.pickle", progress="yes")  # type: ignore[arg-type]


def test_an_error_in_a_callback_is_the_callers_own(tmp_path: Path, small_drains: None) -> None:
    """Not taken for a bad file (nor read again): the caller's error, as raised."""
    path = dumped(tmp_path, training_snapshot(steps=300)[0])

    def view(v: Any) -> None:
        raise KeyError("mine")

    def progress(read: int, of: int) -> None:
        if read > of // 2:
            raise ValueError("mine too")

    with pytest.raises(KeyError, match="mine"):
        load_snapshot(path, first_view=view)
    with pytest.raises(ValueError, match="mine too"):
        load_snapshot(path, progress=progress)


def test_ctrl_c_stops_the_reading_and_leaves_the_session_as_it_was(
    tmp_path: Path, small_drains: None
) -> None:
    import gc

    path = dumped(tmp_path, training_snapshot(steps=300)[0])

    def progress(read: int, of: int) -> None:
        raise KeyboardInterrupt  # what Ctrl-C raises while the file is read

    assert gc.isenabled()
    with pytest.raises(KeyboardInterrupt):
        load_snapshot(path, progress=progress)
    assert gc.isenabled()  # paused while reading, running again
    assert load_snapshot(path).events == training_snapshot(steps=300)[1].events


@pytest.mark.parametrize("free_stacks", [False, True])
def test_forgetting_leaves_the_trace_equal_to_reading_whole(
    tmp_path: Path, free_stacks: bool
) -> None:
    """Each free with its allocation's list of frames (torch's default) or a list of its own
    (``stacks="all"``): the lists forgotten were never needed again."""
    data, truth = training_snapshot(steps=300, free_stacks=free_stacks)
    path = dumped(tmp_path, data)
    seen: list[Any] = []
    original = stream._Drain._forget

    def watched(self: Any, memo: Any) -> None:
        original(self, memo)
        seen.append(self)

    stream._Drain._forget = watched  # type: ignore[method-assign]
    try:
        read, collectors, _ = stream.stream(path, every=2048)
    finally:
        stream._Drain._forget = original  # type: ignore[method-assign]
    assert seen and seen[-1].prune_frames and seen[-1].dropped > truth.events // 4
    streamed = collectors[0].finish(read["segments"], 0)
    same(streamed, from_dict(pickle.loads(path.read_bytes()), "whole").trace)


def test_a_list_referred_to_after_its_free_reads_again_keeping_every_list(
    tmp_path: Path,
) -> None:
    """No torch file seen does it, but a pickle may refer again to a list of frames whose
    allocation was freed: the reading starts over keeping every list, and gives the same."""
    data, _ = training_snapshot(steps=300)
    events = data["device_traces"][0]
    freed = next(e for e in events if e["action"] == "free_completed")
    again = {**freed, "action": "alloc", "addr": 1 << 50}  # the same list object, much later
    events.insert(len(events) - 1, again)
    path = dumped(tmp_path, data)
    modes: list[bool] = []
    original = stream._Drain.__init__

    def watched(self: Any, loader: Any, prune_frames: bool = True) -> None:
        original(self, loader, prune_frames)
        modes.append(prune_frames)

    stream._Drain.__init__ = watched  # type: ignore[method-assign]
    try:
        read, collectors, _ = stream.stream(path, every=2048)
    finally:
        stream._Drain.__init__ = original  # type: ignore[method-assign]
    assert modes == [True, False]
    whole = from_dict(pickle.loads(path.read_bytes()), "whole")
    same(collectors[0].finish(read["segments"], 0), whole.trace)
    assert whole.trace.a_size[-1] == freed["size"]


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_global_is_still_refused_while_streaming(
    tmp_path: Path, protocol: int, small_drains: None
) -> None:
    """The memo swapped in comes from memlab's own bytes; the file's loader still refuses a
    global met after many drains, before calling it."""
    marker = tmp_path / "ran"
    data, _ = training_snapshot(steps=40)
    data["device_traces"][0][-2]["frames"] = [Evil(marker)]
    with pytest.raises(SnapshotError, match=r"posix\.system|nt\.system"):
        load_snapshot(dumped(tmp_path, data, protocol=protocol), first_view=lambda v: None)
    assert not marker.exists()
