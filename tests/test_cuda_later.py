"""A breakdown read from the CUDA allocator's log is replayed when first read
(`memlab.core.cuda_later`), on the CPU through the stand-in allocator: not before, once, the
same figures and notes as a replay at the region's end, from any thread, again after a
Ctrl-C, and the logs waiting bounded."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import pytest
from test_cuda_trace import ev, opened

from memlab.core import cuda_later
from memlab.core.categories import Category
from memlab.core.cuda import Counters, CudaRegion
from memlab.core.cuda_settle import settle
from memlab.core.devices import Target
from memlab.region.assemble import assemble

EVENTS = [  # a 1 KiB temporary, then 512 B kept (an output the test names a parameter)
    ev("alloc", 100, 1024, 1e18 + 10),
    ev("alloc", 200, 512, 1e18 + 20),
    ev("free_requested", 100, 1024, 1e18 + 30),
]


def counted(monkeypatch: Any) -> list[int]:
    """Counts the replays (each call of `settle` from the deferred path)."""
    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return settle(*args, **kwargs)

    monkeypatch.setattr(cuda_later, "settle", counting)
    return calls


def report_of(monkeypatch: Any) -> Any:
    log, _ = opened(monkeypatch, list(EVENTS), [(200, 512)])
    log.names.named.append((200, None, Category.PARAMETER))
    log.stop()
    cr = CudaRegion(0, True)
    cr.start = Counters(0, 2048, 0, 0, 2048, 0, 0)
    cr.end = Counters(512, 2048, 512, 1536, 2048, 0, 0)
    return assemble(
        Target("cuda:0", 0),
        log.tally(True),
        cr,
        seconds=0.1,
        label="step",
        raised=None,
        notes=["a note of the region's"],
        timeline=False,
        driver=False,
    )


def test_the_replay_waits_for_the_first_read_and_is_made_once(monkeypatch: Any) -> None:
    calls = counted(monkeypatch)
    r = report_of(monkeypatch)
    # what the history keeps reads no breakdown: nothing replayed yet
    assert (r.allocated_before, r.allocated_after, r.peak_allocated) == (0, 512, 1536)
    assert calls == [] and cuda_later.waiting() >= 1
    b = r.breakdown
    assert calls == [1]
    assert b.at_peak[Category.TEMPORARY] == 1024 and b.at_peak[Category.PARAMETER] == 512
    assert b.at_end[Category.PARAMETER] == 512 and b.at_end[Category.UNATTRIBUTED] == 0
    assert sum(b.at_peak.values()) == r.peak_allocated
    assert r.notes == ("a note of the region's",)
    assert r.breakdown is b and "TEMPORARY" in r.text().upper() and calls == [1]
    # pickled and copied with the breakdown made; equal to the report it came from
    again = pickle.loads(pickle.dumps(r))
    assert again == r and again.breakdown.at_peak == b.at_peak


def test_notes_wait_with_the_breakdown_and_a_failed_replay_says_why(monkeypatch: Any) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("an event memlab has never seen")

    monkeypatch.setattr(cuda_later, "settle", broken)
    r = report_of(monkeypatch)
    notes = r.notes  # (read first: the breakdown is made with them)
    assert notes[0] == "a note of the region's"
    assert any("could not be settled" in n and "never seen" in n for n in notes)
    assert r.breakdown is None and r.allocated_after == 512  # the totals stand


def test_a_ctrl_c_during_the_replay_leaves_it_to_the_next_read(monkeypatch: Any) -> None:
    first = [True]

    def interrupted_once(*args: Any, **kwargs: Any) -> Any:
        if first.pop() if first else False:
            raise KeyboardInterrupt
        return settle(*args, **kwargs)

    monkeypatch.setattr(cuda_later, "settle", interrupted_once)
    r = report_of(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        r.breakdown  # noqa: B018
    assert r.breakdown.at_peak[Category.TEMPORARY] == 1024  # the same replay, done again


def test_two_threads_reading_at_once_take_one_replay(monkeypatch: Any) -> None:
    started, go = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        started.set()
        go.wait(10)
        return settle(*args, **kwargs)

    monkeypatch.setattr(cuda_later, "settle", slow)
    r = report_of(monkeypatch)
    seen: list[Any] = []
    threads = [threading.Thread(target=lambda: seen.append(r.breakdown)) for _ in range(2)]
    threads[0].start()
    assert started.wait(10)
    threads[1].start()
    go.set()
    for t in threads:
        t.join(10)
    assert calls == [1] and len(seen) == 2 and seen[0] is seen[1] is r.breakdown


def later_of(n: int) -> cuda_later.Later:
    events = [ev("alloc", 100 + 512 * i, 512, 1e18 + i) for i in range(n)]
    return cuda_later.Later(
        events,
        0,
        [],
        [],
        args=[],
        saved_before=[],
        released=set(),
        unsaved=[],
        complete=True,
        limit=10**6,
    )


def test_the_logs_waiting_are_bounded_and_a_dropped_one_lets_its_log_go(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(cuda_later, "PENDING_EVENTS", 10)
    monkeypatch.setattr(cuda_later, "_pending", type(cuda_later._pending)())
    kept = [cuda_later.defer(later_of(4)) for _ in range(2)]
    assert not any(k.made for k in kept) and cuda_later.waiting() == 2
    dropped = cuda_later.defer(later_of(2))  # (10 waiting: not more than may wait)
    del dropped  # (a report nobody kept: its log goes with it, replayed never)
    assert cuda_later.waiting() == 2
    kept.append(cuda_later.defer(later_of(4)))  # 12 events waiting: the oldest made now
    assert [k.made for k in kept] == [True, False, False] and cuda_later.waiting() == 2
    big = cuda_later.defer(later_of(11))  # larger than what may wait: made at once
    # what a log holds besides its events counts too: the blocks alive at its end, its names
    many = cuda_later.Later(
        [],
        0,
        [(512 * i, 512) for i in range(6)],
        [(0, None, Category.PARAMETER)] * 5,
        args=[],
        saved_before=[],
        released=set(),
        unsaved=[],
        complete=True,
        limit=10,
    )
    assert many.events == 11 and cuda_later.defer(many).made
    assert big.made
    tally, notes = kept[0]()
    assert tally is not None and tally.peak == tally.at_peak[Category.OTHER] == 4 * 512
    assert notes == ()


def test_a_ctrl_c_in_an_older_replay_at_a_close_leaves_this_one_whole(monkeypatch: Any) -> None:
    # an older report's log replayed at this region's close (too many entries waiting) is
    # interrupted: the close is tried again, and this region's replay is the same, whole one
    monkeypatch.setattr(cuda_later, "PENDING_EVENTS", 10)
    monkeypatch.setattr(cuda_later, "_pending", type(cuda_later._pending)())
    older = cuda_later.defer(later_of(8))
    calls: list[int] = []

    def interrupted_once(events: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(events))
        if len(calls) == 1:
            raise KeyboardInterrupt
        return settle(events, *args, **kwargs)

    monkeypatch.setattr(cuda_later, "settle", interrupted_once)
    log, _ = opened(monkeypatch, list(EVENTS), [(200, 512)])
    log.names.named.append((200, None, Category.PARAMETER))
    log.stop()
    with pytest.raises(KeyboardInterrupt):
        log.tally(True)
    assert calls == [8] and not older.made and cuda_later.waiting() == 2  # both still wait
    made, _ = log.tally(True).later()  # (the close again)
    assert made is not None and calls[1] == len(EVENTS)
    assert made.at_peak[Category.TEMPORARY] == 1024 and made.at_end[Category.PARAMETER] == 512
    assert older()[0] is not None  # (the interrupted one, made at its read)
