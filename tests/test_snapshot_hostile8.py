"""Hostile round 8 on snapshots: reading a big pickle costs work in proportion to its size (not
its square), counts checked while the file is read, impossible values and a gzip cut short
refused by name, paths of every kind said clearly, and writing to a bad path said without
memlab's frames."""

from __future__ import annotations

import gzip
import pickle
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import memlab
from memlab.snapshot import SnapshotError, from_dict, load_snapshot, stream, unpickle
from memlab.snapshot.synthetic import training_snapshot

MEMLAB = str(Path(memlab.__file__).parent)


def memlab_frames(e: BaseException) -> list[str]:
    return [f"{f.filename}:{f.lineno}" for f in traceback.extract_tb(e.__traceback__)
            if f.filename.startswith(MEMLAB)]  # fmt: skip


def walked(monkeypatch: pytest.MonkeyPatch, path: Path) -> int:
    """Memo entries the reader copied and walked, all its drains together (one every 64 KiB:
    pickle's C loader reads protocol 4 in frames of that size)."""
    seen = [0]
    original = stream._Drain._memo

    def counted(self: Any) -> dict[int, Any]:
        memo = original(self)
        seen[0] += len(memo)
        return memo

    monkeypatch.setattr(stream._Drain, "_memo", counted)
    stream.stream(path, every=4096)
    monkeypatch.setattr(stream._Drain, "_memo", original)
    return seen[0]


EVENT = {"action": "alloc", "addr": 1, "size": 512, "time_us": 0, "frames": []}


@pytest.mark.parametrize("trace_first", [False, True], ids=["no trace", "a trace, then more"])
def test_the_memo_walked_grows_with_the_file_not_its_square(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trace_first: bool
) -> None:
    """A big pickle that is not a snapshot (many distinct strings), with no list of events or
    with a short one before the rest: four times the file, about four times the walking (the
    memo grows with the file, and walking all of it at each drain was quadratic, 16 times:
    70 s for 83 MiB)."""
    work = []
    for n in (100_000, 400_000):
        data: dict[str, Any] = {"segments": []}
        if trace_first:
            data["device_traces"] = [[dict(EVENT)]]
        data["names"] = [f"s{i}" for i in range(n)]
        path = tmp_path / f"{n}.pickle"
        path.write_bytes(pickle.dumps(data, protocol=4))
        work.append(walked(monkeypatch, path))
        assert work[-1] <= 4 * n  # (each entry walked a few times at most)
    assert work[1] < 8 * work[0], work


def test_the_first_view_still_comes_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walks are spaced by what the memo holds: a snapshot's memo is small (its events are
    forgotten), so the segments are still shown at the first drains, and every event read."""
    monkeypatch.setattr(stream, "EVERY", 4096)
    data, truth = training_snapshot(steps=300)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(data, protocol=4))
    order: list[Any] = []
    s = load_snapshot(path, first_view=order.append, progress=lambda n, of: order.append(n))
    at = next(i for i, o in enumerate(order) if not isinstance(o, int))
    assert at <= 2 and len(order) > 10 and s.events == truth.events and s.peak == truth.peak


def test_too_many_segments_are_refused_while_the_file_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted as the list grows, not once the whole file is read: the refusal comes before the
    reading reaches what follows the segments."""
    monkeypatch.setattr(stream, "EVERY", 4096)
    segment = {"device": 0, "address": 0, "total_size": 2**21, "blocks": []}
    junk = [f"s{i}" for i in range(300_000)]
    path = tmp_path / "many.pickle"
    path.write_bytes(pickle.dumps({"segments": [segment] * 200_000, "junk": junk}, protocol=4))
    segments_end = len(pickle.dumps({"segments": [segment] * 200_000}, protocol=4))
    read: list[int] = []
    with pytest.raises(SnapshotError, match=r"segments, more than memlab reads \(100,000") as e:
        load_snapshot(path, progress=lambda n, of: read.append(n))
    assert max(read) < segments_end + 2**17 < path.stat().st_size // 2
    assert not memlab_frames(e.value)


def test_more_lists_of_events_than_devices_are_refused(tmp_path: Path) -> None:
    """One list of events a device, 128 devices at most: each list found was walked at every
    drain, so thousands of them made the reading quadratic too."""
    for every in (4096, None):  # found while reading, or at the end
        traces = [[dict(EVENT)] for _ in range(200 if every is None else 5000)]
        path = tmp_path / "traces.pickle"
        path.write_bytes(pickle.dumps({"segments": [], "device_traces": traces}, protocol=4))
        with pytest.raises(SnapshotError, match=r"more than 128 lists of events"):
            stream.stream(path, every=every)


@pytest.mark.parametrize(
    ("where", "value", "says"),
    [
        ("total_size", -5, r"a segment's total_size is -5 bytes; sizes are never negative"),
        ("size", -5, r"a block's size is -5 bytes; sizes are never negative"),
        ("device", 2**70, r"a segment is on device 1180591620717411303424, which no GPU is"),
        ("device", -1, r"a segment is on device -1, which no GPU is"),
        ("event", -5, r"an event's size is -5 bytes; sizes are never negative"),
    ],
)
def test_impossible_values_are_refused_by_name(
    tmp_path: Path, where: str, value: int, says: str
) -> None:
    block = {"address": 0, "size": 512, "state": "active_allocated"}
    segment = {"device": 0, "address": 0, "total_size": 2**21, "blocks": [block]}
    event = dict(EVENT)
    if where == "size":
        block["size"] = value
    elif where == "event":
        event["size"] = value
    else:
        segment[where] = value
    data = {"segments": [segment], "device_traces": [[event]]}
    path = tmp_path / "odd.pickle"
    path.write_bytes(pickle.dumps(data, protocol=4))
    for read in (lambda: load_snapshot(path), lambda: from_dict(data, "in memory")):
        with pytest.raises(SnapshotError, match=says) as e:
            read()
        assert not memlab_frames(e.value)


def test_a_gzip_cut_short_or_damaged_is_refused(tmp_path: Path) -> None:
    """pickle stops at its own end, before gzip's trailer (CRC and length): read to the end."""
    data, truth = training_snapshot(steps=3)
    whole = gzip.compress(pickle.dumps(data, protocol=4))
    flipped = bytearray(whole)
    flipped[-6] ^= 0xFF  # the CRC
    for name, raw, says in (
        ("cut.pickle.gz", whole[:-8], "cut short or damaged.*EOFError"),
        ("crc.pickle.gz", bytes(flipped), "cut short or damaged.*CRC check failed"),
    ):
        path = tmp_path / name
        path.write_bytes(raw)
        with pytest.raises(SnapshotError, match=says) as e:
            load_snapshot(path)
        assert not memlab_frames(e.value)
        with pytest.raises(SnapshotError, match=says):
            unpickle.read(path)
    path = tmp_path / "whole.pickle.gz"
    path.write_bytes(whole)
    assert load_snapshot(path).peak == truth.peak  # (the whole file: read)


class PathOfMine:
    """An os.PathLike that is not a pathlib.Path."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return str(self.path)


def test_paths_of_every_kind(tmp_path: Path) -> None:
    data, truth = training_snapshot(steps=3)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(data, protocol=4))
    assert load_snapshot(PathOfMine(path)).peak == truth.peak  # type: ignore[arg-type]
    assert unpickle.read(PathOfMine(path))["segments"] == data["segments"]  # type: ignore[arg-type]
    with pytest.raises(SnapshotError, match=r"'/dev/null' is not a regular file but a char") as e:
        load_snapshot("/dev/null")
    assert not memlab_frames(e.value)
    with pytest.raises(TypeError, match=r"path=b'x\.pickle' is a bytes"):
        load_snapshot(b"x.pickle")  # type: ignore[arg-type]


def tracked() -> memlab.MemoryReport:
    with memlab.track(device="cpu", timeline=True) as r:
        a = torch.ones(4096)
        del a
    report = r.report if hasattr(r, "report") else r
    assert isinstance(report, memlab.MemoryReport)
    return report


def test_writing_to_a_bad_path_names_it_without_memlabs_frames(tmp_path: Path) -> None:
    """A report's, a loaded snapshot's and a chart's writers: a folder that does not exist, a
    directory, not a path; and an os.PathLike written to."""
    report = tracked()
    snap = load_snapshot(report.to_snapshot(PathOfMine(tmp_path / "r.pickle")))  # type: ignore[arg-type]
    chart = snap.chart()
    for write in (report.to_snapshot, snap.to_snapshot, chart.save):
        for bad, kind, says in (
            (tmp_path / "nope" / "x", FileNotFoundError, r"the folder '.*nope' does not exist"),
            (tmp_path, IsADirectoryError, r"is a directory: pass a file name in it, such as"),
            (b"x.pickle", TypeError, r"path=b'x\.pickle' is a bytes: pass a file name"),
        ):
            with pytest.raises(kind, match=says) as e:
                write(bad)
            assert not memlab_frames(e.value), (write, memlab_frames(e.value))
    out = chart.save(PathOfMine(tmp_path / "c.html"))  # type: ignore[arg-type]
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert load_snapshot(snap.to_snapshot(tmp_path / "again.pickle")).peak == snap.peak


def test_a_file_the_system_will_not_create_is_named() -> None:
    """The folder exists, but the system refuses the file (/proc takes no new files, even from
    root): the same kind of OSError, naming the path and what to pass."""
    with pytest.raises(
        FileNotFoundError, match=r"'/proc/x\.pickle': the file cannot be written"
    ) as e:
        tracked().to_snapshot("/proc/x.pickle")
    assert "a folder you can write to" in str(e.value) and not memlab_frames(e.value)
