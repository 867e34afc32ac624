"""Snapshots in and out: `memlab.load_snapshot` against real allocator traces recorded on an H100
(tests/data, with the allocator's own counters as the truth) and against made-up snapshots in
torch's format whose figures are known; malicious pickles refused with nothing run; memlab
timelines written as snapshots that torch's viewer functions and memlab read back equal."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.cuda import _memory_viz as viz  # torch's snapshot viewer, public functions only

import memlab
from memlab.examples.recorded import gpu_snapshot
from memlab.snapshot import SnapshotError, from_dict, load_snapshot
from memlab.snapshot.synthetic import USER_FILE, training_snapshot
from memlab.snapshot.trace import reduce

DATA = Path(__file__).parent / "data"
REAL = sorted(DATA.glob("trace-*.json.gz"))


def real(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    d = json.loads(gzip.decompress(path.read_bytes()))
    return {"segments": d["segments"], "device_traces": d["device_traces"]}, d["stats"]


def dumped(tmp_path: Path, data: Any, name: str = "snap.pickle", protocol: int = 4) -> Path:
    p = tmp_path / name
    p.write_bytes(pickle.dumps(data, protocol=protocol))
    return p


# -- reading ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name.split(".")[0])
def test_a_recorded_trace_gives_the_allocators_own_figures(path: Path, tmp_path: Path) -> None:
    """Recorded on an H100 (torch 2.11) with the allocator's counters beside the trace: the
    segments' figures are the counters' exactly; the trace's peak counts requested bytes, so it
    lies at most 1% under max_memory_allocated (which counts whole blocks)."""
    data, stats = real(path)
    s = load_snapshot(dumped(tmp_path, data))
    assert s.allocated == stats["final_allocated"]
    assert s.reserved == stats["final_reserved"]
    assert s.events == len(data["device_traces"][0])
    assert int(s.trace.totals[-1]) == s.allocated  # the trace ends where the segments are
    if "peak_allocated" in stats:
        assert 0 <= stats["peak_allocated"] - s.peak <= stats["peak_allocated"] // 100
    assert s.before == 0 and not s.notes


def test_a_made_up_training_snapshot_gives_its_known_figures(tmp_path: Path) -> None:
    data, truth = training_snapshot(steps=4)
    s = load_snapshot(dumped(tmp_path, data))
    assert (s.before, s.peak, s.allocated, s.reserved) == (
        truth.before,
        truth.peak,
        truth.end,
        truth.reserved,
    )
    assert s.events == truth.events
    assert s.top[0].size == truth.largest and s.top[0].line == truth.largest_line
    # read as it streams in, or whole: the same report
    assert s.to_dict() == dataclasses.replace(from_dict(data, s.path)).to_dict()
    assert {a.line for a in s.live} == {f"{USER_FILE}:{n} in train" for n in (12, 37)}
    assert [a.size for a in s.top] == sorted((a.size for a in s.top), reverse=True)
    # the free cache is the segment's inactive blocks
    free = [b["size"] for b in data["segments"][0]["blocks"] if b["state"] == "inactive"]
    assert s.free_cache == sum(free) and s.largest_free == max(free)
    assert s.fragmentation == pytest.approx(1 - max(free) / sum(free))
    # groups read from the frames: what forward made was freed by the end of each step
    groups = s.trace.by_group()
    assert groups.sum(axis=0).tolist() == s.trace.totals.tolist()
    assert groups[1, -1] == 0 and groups[3, -1] > 0  # forward: none left; optimizer state: kept
    assert "before the trace began" in s.notes[0]
    assert s.timeline.allocated[-1] == truth.end and max(s.timeline.allocated) == truth.peak


def test_the_report_renders_and_round_trips_as_json(tmp_path: Path) -> None:
    data, truth = training_snapshot(steps=2)
    s = from_dict(data, "step <1>.pickle")
    d = json.loads(json.dumps(s.to_dict()))
    assert d["peak"] == truth.peak and d["top"][0]["size"] == truth.largest
    assert "train.py:34 in train" in s.text() and "train.py:34 in train" in s._repr_html_()
    assert "step &lt;1&gt;.pickle" in s._repr_html_()
    assert s.report.peak_allocated == truth.peak and s.report.allocated_before == truth.before


def test_a_gzipped_snapshot_and_the_device_argument(tmp_path: Path) -> None:
    data, truth = training_snapshot(steps=1)
    data["device_traces"] = [[], data["device_traces"][0]]
    data["segments"][0]["device"] = 1
    p = tmp_path / "snap.pickle.gz"
    p.write_bytes(gzip.compress(pickle.dumps(data)))
    assert load_snapshot(p).peak == truth.peak and load_snapshot(p).device == 1
    assert load_snapshot(p, device=0).events == 0
    with pytest.raises(ValueError, match="device=5: the snapshot has traces for devices 0 to 1"):
        load_snapshot(p, device=5)


def test_an_oom_event_is_named(tmp_path: Path) -> None:
    data, _ = training_snapshot(steps=1)
    data["device_traces"][0].append(
        {"action": "oom", "addr": 0, "size": 3 << 30, "stream": 0, "device_free": 1 << 30,
         "time_us": data["device_traces"][0][-1]["time_us"] + 10, "frames": []}
    )  # fmt: skip
    s = from_dict(data, "oom")
    assert any("out of memory" in n and "3.00 GiB asked for" in n for n in s.notes)


# -- refusing ----------------------------------------------------------------------------------
class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_malicious_pickle_is_refused_and_nothing_runs(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "ran"
    data, _ = training_snapshot(steps=1)
    data["device_traces"][0][3]["frames"] = [Evil(marker)]
    p = dumped(tmp_path, data, "evil.pickle", protocol)
    with pytest.raises(SnapshotError) as e:
        load_snapshot(p)
    assert str(p) in str(e.value) and f"{os.system.__module__}.system" in str(e.value)
    assert not marker.exists()
    pickle.loads(p.read_bytes())  # the plain unpickler would have run it: the test is real
    assert marker.exists()


def test_a_few_bytes_listing_millions_of_blocks_are_refused_at_once(tmp_path: Path) -> None:
    # a pickle's memo lists one block again and again: 1,100 x 1,000 blocks in 4 KB
    block = {"address": 0, "size": 512, "requested_size": 512, "state": "active_allocated"}
    segment = {"device": 0, "address": 0, "total_size": 512_000, "blocks": [block] * 1000}
    path = tmp_path / "bomb.pickle"
    path.write_bytes(pickle.dumps({"segments": [segment] * 1100, "device_traces": [[]]}))
    assert path.stat().st_size < 10_000
    for read in (
        lambda: load_snapshot(path),
        lambda: load_snapshot(path, first_view=print),
        lambda: from_dict({"segments": [segment] * 1100}, "in memory"),
    ):
        with pytest.raises(SnapshotError, match="lists 1,100,000 blocks in 1,100 segments"):
            read()
    many = tmp_path / "segments.pickle"  # a segment listed 200,000 times
    many.write_bytes(pickle.dumps({"segments": [dict(segment, blocks=[])] * 200_000}))
    with pytest.raises(SnapshotError, match="lists 200,000 segments"):
        load_snapshot(many)
    small = tmp_path / "small.pickle"  # (below the limit: read)
    small.write_bytes(pickle.dumps({"segments": [segment] * 10, "device_traces": [[]]}))
    assert load_snapshot(small).allocated == 10 * 1000 * 512


def test_other_globals_and_bad_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match=r"builtins\.eval"):
        load_snapshot(dumped(tmp_path, {"segments": [], "x": eval}))
    with pytest.raises(SnapshotError, match=r"collections\.OrderedDict"):
        from collections import OrderedDict

        load_snapshot(dumped(tmp_path, {"segments": OrderedDict()}))
    with pytest.raises(SnapshotError, match="holds a list without 'segments'"):
        load_snapshot(dumped(tmp_path, [1, 2]))
    junk = tmp_path / "junk.pickle"
    junk.write_bytes(b"not a pickle at all")
    with pytest.raises(SnapshotError, match="not a readable pickle"):
        load_snapshot(junk)
    with pytest.raises(FileNotFoundError, match=r"path='nowhere\.pickle': no such file"):
        load_snapshot("nowhere.pickle")
    with pytest.raises(TypeError, match="path=3 is a int"):
        load_snapshot(3)  # type: ignore[arg-type]


# -- writing -------------------------------------------------------------------------------------
def tracked() -> memlab.MemoryReport:
    keep = torch.zeros(1000)
    with memlab.track(device="cpu", timeline=True) as r:
        a = [torch.ones(256 * (i + 1)) for i in range(20)]  # 1 KiB ... 20 KiB
        del a[::2]
        b = torch.empty(64, 64)  # 16 KiB
        del a
    del b, keep
    report = r.report if hasattr(r, "report") else r
    assert isinstance(report, memlab.MemoryReport)
    return report


def changes(seconds: Any, totals: Any, start: int) -> list[tuple[float, int]]:
    """(time, total) where the total changes, the last of equal times, times from the first."""
    out: list[tuple[float, int]] = []
    level = start
    for t, v in zip(seconds, totals, strict=True):
        if out and out[-1][0] == pytest.approx(t, abs=1e-9):
            out[-1] = (out[-1][0], int(v))
        elif v != level:
            out.append((float(t), int(v)))
        level = int(v)
    return [(t - out[0][0], v) for t, v in out]


def test_a_tracked_region_round_trips_through_a_snapshot(tmp_path: Path) -> None:
    r = tracked()
    sizes = [256 * (i + 1) * 4 for i in range(20)]
    assert r.peak_allocated == r.allocated_before + sum(sizes)  # tensors the test made
    s = load_snapshot(r.to_snapshot(tmp_path / "region.pickle"))
    assert (s.before, s.peak, s.allocated) == (
        r.allocated_before,
        r.peak_allocated,
        r.allocated_after,
    )
    assert r.timeline is not None
    mine = changes(r.timeline.seconds, r.timeline.allocated, r.allocated_before)
    back = changes(s.timeline.seconds, s.timeline.allocated, s.before)
    assert [v for _, v in back] == [v for _, v in mine]
    assert [t for t, _ in back] == pytest.approx([t for t, _ in mine], abs=1e-6)


def test_torchs_viewer_functions_read_what_memlab_writes(tmp_path: Path) -> None:
    flat = {"format_flamegraph": lambda lines: lines}  # torch's default downloads a script
    for path in (
        tracked().to_snapshot(tmp_path / "region.pickle"),
        from_dict(training_snapshot(steps=2)[0], "made up").to_snapshot(tmp_path / "again.pickle"),
    ):
        data = pickle.loads(path.read_bytes())
        assert ";active_allocated;" in viz.segments(data, **flat)
        assert viz.memory(data, **flat).strip()
        summary = viz.segsum(data)  # asserts every segment's bytes add up
        assert "total_reserved" in summary
        assert "TOTAL MEM" in viz.trace(data)
        assert "Active Memory Timeline" in viz.trace_plot(pickle.loads(path.read_bytes()))
        viz.trace_plot(pickle.loads(path.read_bytes()), filter_freed=True)
        assert "only_after" in viz.compare([], data["segments"], **flat)


def test_a_loaded_snapshot_writes_itself_back_equal(tmp_path: Path) -> None:
    data, truth = training_snapshot(steps=3)
    s = from_dict(data, "first")
    s.to_snapshot(tmp_path / "again.pickle")
    again = load_snapshot(tmp_path / "again.pickle")
    assert (again.before, again.peak, again.allocated) == (truth.before, truth.peak, truth.end)
    assert again.trace.totals.tolist() == s.trace.totals.tolist()
    assert again.trace.groups.tolist() == s.trace.groups.tolist()
    assert [(a.size, a.line) for a in again.top] == [(a.size, a.line) for a in s.top]


def test_an_estimate_writes_its_predicted_timeline(tmp_path: Path) -> None:
    from torch import nn

    from memlab.estimate import estimate

    e = estimate(
        lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)),
        lambda n: torch.randn(n, 64),
        config={"batch_size": 16, "optimizer": "adam"},
        gpu="T4",
    )
    tl = e.report.timeline
    assert tl is not None
    s = load_snapshot(e.to_snapshot(tmp_path / "predicted.pickle"))
    assert s.peak == max(e.report.allocated_before, *tl.allocated)
    assert s.before == e.report.allocated_before and s.timeline.allocated[-1] == tl.allocated[-1]


def test_without_a_timeline_the_error_says_how_to_get_one(tmp_path: Path) -> None:
    with memlab.track(device="cpu") as r:
        torch.ones(10)
    report = r.report if hasattr(r, "report") else r
    with pytest.raises(ValueError, match=r"to_snapshot\(\) needs a timeline.*timeline=True"):
        report.to_snapshot(tmp_path / "x.pickle")


# -- the interactive chart ------------------------------------------------------------------------
def test_the_reduction_keeps_the_peak_and_the_floor() -> None:
    rng = np.random.default_rng(0)
    walk = np.cumsum(rng.integers(-1000, 1001, 1_000_000)).astype(np.int64)
    keep = reduce(walk, 6000)
    assert len(keep) <= 6000 and np.all(np.diff(keep) > 0)
    assert walk.argmax() in keep and walk.argmin() in keep and keep[-1] == len(walk) - 1


def test_the_chart_needs_no_network(tmp_path: Path) -> None:
    data, _ = training_snapshot(steps=3)
    chart = from_dict(data, "step").chart()
    html = chart.html()
    # three pieces: the element, Bokeh's own library inline, the call that draws the figure
    element, library, call = html.split("<script>")
    from bokeh.resources import Resources

    bundle = Resources(mode="inline", components=["bokeh"]).js_raw
    assert library.removesuffix("</script>\n") == "\n".join(bundle)
    for mine in (element, call):
        assert "src=" not in mine and "http" not in mine and "import" not in mine
    assert "Bokeh.embed.embed_item" in call
    item = json.loads(chart.item)
    text = json.dumps(item)
    assert "train.py:34 in train" in text and "made in forward" in text
    assert chart.events == len(from_dict(data, "step").trace.times)
    page = chart.save(tmp_path / "chart.html")
    assert page.read_text().startswith("<!DOCTYPE html>")
    assert memlab.load_snapshot is load_snapshot and sys.modules["memlab.snapshot"]


# -- reading as the file streams in ------------------------------------------------------------
def same(a: Any, b: Any) -> None:
    """Two `Trace`s hold the same figures."""
    for name in ("times", "totals", "groups", "deltas", "owner", "reserved", "a_start"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert np.array_equal(a.a_end, b.a_end, equal_nan=True)
    assert [a.lines[i] for i in a.a_line] == [b.lines[i] for i in b.a_line]
    assert (a.before, a.peak, a.timed, a.ooms) == (b.before, b.peak, b.timed, b.ooms)


@pytest.mark.parametrize("every", [512, 4096, 1 << 20])
@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_reading_as_it_streams_gives_what_reading_whole_gives(
    tmp_path: Path, every: int, protocol: int
) -> None:
    """Events taken out of the loader every ``every`` bytes (each time in another state: inside
    an event, a batch, a list of frames shared by later events), against the dict read whole."""
    from memlab.snapshot import stream

    data, truth = training_snapshot(steps=6)
    path = dumped(tmp_path, data, protocol=protocol)
    whole = from_dict(pickle.loads(path.read_bytes()), "whole")
    read, collectors, _ = stream.stream(path, every=every)
    assert read["device_traces"] == [[]]  # every event went to its collector
    streamed = collectors[0].finish(read["segments"], 0)
    same(streamed, whole.trace)
    assert streamed.peak == truth.peak and collectors[0].events == truth.events


@pytest.mark.parametrize("path", REAL[:3], ids=lambda p: p.name.split(".")[0])
def test_a_recorded_trace_streams_as_it_reads_whole(path: Path, tmp_path: Path) -> None:
    from memlab.snapshot import stream

    data, _ = real(path)
    p = dumped(tmp_path, data)
    _, collectors, _ = stream.stream(p, every=2048)
    same(collectors[0].finish(data["segments"], 0), from_dict(data, "whole").trace)


def test_the_loader_keeps_no_event_after_a_drain(tmp_path: Path) -> None:
    """What bounds the memory: each time the loader's memo is made to forget, it keeps no event
    dict, and of the lists of frames read (``[READ, Known]``) only those of allocations not yet
    freed; between, the events taken are emptied dicts."""
    from memlab.snapshot import stream
    from memlab.snapshot.faults import READ

    data, truth = training_snapshot(steps=300)
    p = dumped(tmp_path, data)
    seen: list[tuple[int, int, int, int]] = []
    original = stream._Drain._forget

    def watched(self: Any, memo: Any) -> None:
        original(self, memo)
        memo = list(self.loader.memo.copy().values())
        full = sum(1 for o in memo if type(o) is dict and "action" in o)
        empty = sum(1 for o in memo if type(o) is dict and not o)
        unread = sum(
            1 for o in memo if type(o) is list and o and type(o[0]) is dict and "line" in o[0]
        )
        read = sum(1 for o in memo if type(o) is list and o and o[0] is READ)
        seen.append((full, empty, unread, read))

    stream._Drain._forget = watched  # type: ignore[method-assign]
    try:
        _, collectors, _ = stream.stream(p, every=4096)
    finally:
        stream._Drain._forget = original  # type: ignore[method-assign]
    assert len(seen) > 5 and collectors[0].events == truth.events
    # left unread: the lists of frames of the batch being read (pickle appends up to 1,000
    # events at a time), and the blocks' lists (the segments)
    blocks = sum(1 for b in data["segments"][0]["blocks"] if b.get("frames"))
    # and one empty dict: the snapshot's own, filled when the file ends
    assert all(f == 0 and e <= 1 and u <= blocks + 1000 for f, e, u, _ in seen), seen
    # read and kept: at most the allocations live at once (12 activations, 6 gradients and 12
    # optimizer states in this loop), not one an allocation of the trace
    assert max(read for *_, read in seen) <= 30, seen


def test_reading_whole_refuses_a_file_too_big_for_the_memory_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memlab.snapshot import unpickle

    data, _ = training_snapshot(steps=2)
    p = dumped(tmp_path, data)
    monkeypatch.setattr(unpickle, "available_memory", lambda: p.stat().st_size * 2)
    with pytest.raises(SnapshotError, match=r"GiB are available.*check_memory=False"):
        unpickle.read(p)
    assert unpickle.read(p, check_memory=False)["device_traces"] == data["device_traces"]
    marker = tmp_path / "ran"
    data["segments"][0]["frames"] = [Evil(marker)]
    with pytest.raises(SnapshotError, match=r"posix\.system|nt\.system"):
        unpickle.read(dumped(tmp_path, data, "evil.pickle"), check_memory=False)
    assert not marker.exists()


def test_a_snapshot_without_events_says_so() -> None:
    s = from_dict({"segments": [], "device_traces": []}, "empty")
    assert s.peak == 0 and "no allocations" in s.text() and "no events recorded" in s.text()
    with pytest.raises(
        ValueError, match=r"no allocations or frees to draw.*_record_memory_history"
    ):
        s.chart()


def test_a_snapshot_file_recorded_on_a_gpu_reads_as_its_allocator_said() -> None:
    """memlab.examples.recorded.gpu_snapshot() is what torch.cuda.memory._snapshot() returned on
    an H100 after a GPT training step (scripts/trace_to_snapshot.py wrote it as _dump_snapshot
    would); the allocator's own counters of that run are in the trace beside it."""
    path = gpu_snapshot()
    _, stats = real(DATA / "trace-gpt-adam.json.gz")
    s = load_snapshot(path)
    assert (s.allocated, s.reserved) == (stats["final_allocated"], stats["final_reserved"])
    assert 0 <= stats["peak_allocated"] - s.peak <= stats["peak_allocated"] // 100
    assert s.events == 1552
