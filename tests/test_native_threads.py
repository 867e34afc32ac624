"""Threads a CPU region starts (`memlab.core.native.joiner`): the native record follows their
ops, to the byte; a region the dispatch mode measures says it does not; the threading module's
profile hook is the program's again after the region, and a thread that outlives the region
leaves the record's key behind at its next op.

The figures are checked against the bytes of the tensors the test's threads make, with the
threads and the region's thread taking turns through events, so each peak is exact.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import run

import memlab
from memlab.core import native

pytestmark = pytest.mark.skipif(native.too_old() is not None, reason=str(native.too_old()))


def key_on() -> bool:
    """Whether the record's dispatch key is included on this thread."""
    return "Fake" in str(torch._C._dispatch_tls_local_include_set())


@pytest.fixture
def key_route(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if native.unavailable() is not None or not native.has_mode_key(native._torch_dirs()[0]):
        pytest.skip("needs the native record and a PyTorch with the Fake dispatch key")
    monkeypatch.setenv("MEMLAB_NATIVE", "1")
    lib = native.library()
    assert lib is not None
    lib.mn_prefer_records(0)
    before = threading.getprofile()
    yield
    assert threading.getprofile() is before
    assert not key_on()


def turns(breakdown: bool) -> tuple[Any, dict[str, Any]]:
    """A region whose thread and a thread it starts take turns: the thread makes a tensor it
    keeps (40,000 B) and one it frees after the region's thread made its own (80,000 B and
    12,000 B); the peak is all three at once."""
    box: dict[str, Any] = {}
    made, go_on = threading.Event(), threading.Event()

    def worker() -> None:
        box["kept"] = torch.ones(10_000)
        passing = torch.ones(20_000)
        made.set()
        go_on.wait(10)
        box["saw"] = int(passing.numel())
        del passing

    gc.collect()
    with memlab.track("cpu", breakdown=breakdown) as t:
        th = threading.Thread(target=worker)
        th.start()
        assert made.wait(10)
        mine = torch.ones(3000)
        go_on.set()
        th.join(10)
        del mine
    return t, box


@pytest.mark.parametrize("breakdown", [False, True])
def test_a_thread_started_in_the_region_is_counted_to_the_byte(
    key_route: None, breakdown: bool
) -> None:
    t, box = turns(breakdown)
    r = t.report
    assert t._native is not None and native.route() == "dispatch key"
    assert box["saw"] == 20_000 and box["kept"].numel() == 10_000
    assert r.allocated_after - r.allocated_before == 40_000
    assert r.peak_delta == 40_000 + 80_000 + 12_000
    assert not [n for n in r.notes if "thread" in n]
    if breakdown:
        assert r.breakdown is not None
        assert sum(r.breakdown.at_peak.values()) == r.peak_allocated


def test_the_dispatch_mode_says_it_did_not_follow_the_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MEMLAB_NATIVE", "0")
    before = threading.getprofile()
    t, box = turns(False)
    r = t.report
    assert t._native is None
    assert box["kept"].numel() == 10_000
    assert r.peak_delta == 12_000  # the region's own thread only
    said = [n for n in r.notes if "thread" in n]
    assert said and said[0].startswith("1 thread(s) started here"), r.notes
    assert threading.getprofile() is before


def test_the_programs_profile_hook_is_kept_and_sees_the_threads(key_route: None) -> None:
    """A hook the program gave `threading.setprofile` is the threads' again (it sees their
    calls) and the threading module's after the region; one the program sets inside the
    region stays."""
    seen: list[str] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        seen.append(f"{event}:{frame.f_code.co_name}")

    def work() -> None:
        torch.ones(10)

    def runs_on_thread() -> None:
        th = threading.Thread(target=work)
        th.start()
        th.join(10)

    threading.setprofile(hook)
    try:
        with memlab.track("cpu") as t:
            runs_on_thread()
        assert threading.getprofile() is hook
        assert "call:work" in seen  # the program's hook, on the thread memlab joined
        assert t._native is not None
    finally:
        threading.setprofile(None)

    other = sys.getprofile()  # (None: pytest sets none)
    with memlab.track("cpu"):
        threading.setprofile(hook)  # the program's, set inside: left as it is
    try:
        assert threading.getprofile() is hook and sys.getprofile() is other
    finally:
        threading.setprofile(None)


def test_a_thread_outliving_the_region_drops_the_key_at_its_next_op(key_route: None) -> None:
    box: dict[str, Any] = {}
    started, closed = threading.Event(), threading.Event()

    def worker() -> None:
        box["in"] = torch.ones(100)
        box["key in region"] = key_on()
        started.set()
        closed.wait(10)
        box["after"] = torch.ones(100) * 2  # an op after the region: the key goes
        box["key after"] = key_on()

    with memlab.track("cpu") as t:
        th = threading.Thread(target=worker)
        th.start()
        assert started.wait(10)
    closed.set()
    th.join(10)
    assert box["key in region"] and not box["key after"]
    assert t.report.allocated_after - t.report.allocated_before == 400
    assert torch.equal(box["after"], torch.full((100,), 2.0))


def test_a_thread_started_in_a_magic_cell_is_in_its_report(key_route: None, ip: Any) -> None:
    """`%%gpumem` on the CPU: the report counts what the cell's thread made."""
    r = run(
        ip,
        "%%gpumem -q -d cpu -o thread_report\n"
        "import threading\n"
        "box = {}\n"
        "th = threading.Thread(target=lambda: box.setdefault('t', torch.zeros(250_000)))\n"
        "th.start(); th.join()",
    )
    assert r.success
    rep = ip.user_ns["thread_report"]
    assert rep.allocated_after - rep.allocated_before == 1_000_000
    assert ip.user_ns["box"]["t"].numel() == 250_000
