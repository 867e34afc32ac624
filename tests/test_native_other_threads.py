"""Memory a thread started before a CPU region allocates while it is open is not in its figures
(the native record follows the region's own thread and the threads it starts): the report says
how much, so that the figures are never silently short. Checked against the bytes the test's
threads made."""

from __future__ import annotations

import threading

import pytest
import torch
from test_native_threads import key_route  # noqa: F401  (a fixture)

import memlab
from memlab.core import native

pytestmark = pytest.mark.skipif(
    native.unavailable() is not None, reason="the native record does not load here"
)
HELD = "another thread allocated here and still holds are not counted"


def _worker(box: dict[str, torch.Tensor], go: threading.Event, done: threading.Event) -> None:
    go.wait(10)
    box["made"] = torch.ones(1000)  # 4,000 bytes, alive after the region
    torch.ones(5000)  # made and freed: nothing to say
    done.set()


def test_a_thread_started_before_the_region_is_said_with_its_bytes() -> None:
    box: dict[str, torch.Tensor] = {}
    go, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=_worker, args=(box, go, done))
    worker.start()
    with memlab.track("cpu") as t:
        mine = torch.ones(250)
        go.set()
        assert done.wait(10)
    worker.join(10)
    assert t._native is not None
    r = t.report
    assert r.allocated_delta == 1000 == mine.untyped_storage().nbytes()  # the thread's: out
    said = [n for n in r.notes if HELD in n]
    assert said == [
        "4,000 bytes in 1 block(s) another thread allocated here and still holds are not "
        "counted: the record follows the region's own thread and the threads it starts, not "
        "one started before it"
    ]


def test_a_thread_the_region_starts_is_counted_and_not_said(key_route: None) -> None:  # noqa: F811
    box: dict[str, torch.Tensor] = {}
    go, done = threading.Event(), threading.Event()
    go.set()
    with memlab.track("cpu") as t:
        worker = threading.Thread(target=_worker, args=(box, go, done))
        worker.start()
        worker.join(10)
    assert t._native is not None
    assert t.report.allocated_delta == box["made"].untyped_storage().nbytes() == 4000
    assert not [n for n in t.report.notes if HELD in n]


def test_a_region_without_threads_says_nothing_of_them() -> None:
    with memlab.track("cpu") as t:
        x = torch.ones(100)
    assert t.report.allocated_delta == x.untyped_storage().nbytes()
    assert not [n for n in t.report.notes if "thread" in n]
