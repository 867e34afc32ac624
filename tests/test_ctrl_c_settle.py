"""A Ctrl-C while a big region settles (seconds, after millions of events) is held off until
the region is settled, then delivered once: the settling is never cut and done again (pressing
Ctrl-C three times used to redo it three times and leave the native record held), the figures
are whole, the program is interrupted right after, and the SIGINT handler in place before is in
place after (memlab.core.interrupts)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import memlab
from memlab.core.interrupts import held_interrupts
from memlab.core.native import handover
from memlab.core.native import region as native_region
from memlab.region import args as region_args


@pytest.fixture
def python_handler() -> Iterator[None]:
    """Python's own SIGINT handler, as in a notebook's kernel while a cell runs (a test runner's
    worker may ignore SIGINT)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("presses", [1, 3])
def test_a_ctrl_c_while_a_big_region_settles_comes_once_it_is_settled(
    monkeypatch: pytest.MonkeyPatch, python_handler: None, presses: int
) -> None:
    with memlab.track("cpu"):  # (the self-check has run: it reads storages the same way)
        pass
    monkeypatch.setattr(native_region, "HOLD_AFTER", 0)  # every region is big here
    real, calls = handover.storage_from_weak, []

    def pressed(weak: int) -> Any:
        calls.append(weak)
        if len(calls) == 1:
            for _ in range(presses):
                ctrl_c()
        return real(weak)

    monkeypatch.setattr(handover, "storage_from_weak", pressed)
    settle, settled = native_region.NativeRegion._settle, []

    def counted(self: Any, *args: Any) -> Any:
        settled.append(1)
        return settle(self, *args)

    monkeypatch.setattr(native_region.NativeRegion, "_settle", counted)
    x = torch.ones(1000)  # read by the region: found when it settles
    t = memlab.track("cpu")
    with pytest.raises(KeyboardInterrupt), t:
        y = x * 2
    assert t._native is not None
    assert calls and len(settled) == 1  # settled once: the Ctrl-C did not cut it
    r = t.report
    assert (r.allocated_before, r.peak_allocated - r.allocated_before) == (4000, 4000)
    assert r.allocated_after - r.allocated_before == y.nbytes
    assert region_args.CLOSED_THROUGH_CTRL_C in r.notes
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.setattr(handover, "storage_from_weak", real)
    with memlab.track("cpu") as again:  # the record was released: the next region is native
        torch.ones(10)
    assert again._native is not None and again.report.peak_delta == 40


def test_a_small_region_is_not_held(monkeypatch: pytest.MonkeyPatch, python_handler: None) -> None:
    """Below the threshold the handler is never swapped (no cost per cell)."""
    swapped: list[Any] = []
    real = signal.signal
    monkeypatch.setattr(signal, "signal", lambda *a: swapped.append(a) or real(*a))
    with memlab.track("cpu") as t:
        torch.ones(10) * 2
    assert t._native is not None and swapped == []


def test_the_programs_own_handler_gets_the_ctrl_c_after_the_block() -> None:
    heard: list[int] = []
    own = lambda signum, frame: heard.append(signum)  # noqa: E731
    before = signal.signal(signal.SIGINT, own)
    try:
        with held_interrupts():
            ctrl_c()
            ctrl_c()
            assert heard == []  # (held)
        assert heard == [signal.SIGINT]  # once
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_handler_the_block_installs_stays(python_handler: None) -> None:
    theirs = lambda signum, frame: None  # noqa: E731
    with held_interrupts():
        signal.signal(signal.SIGINT, theirs)
    assert signal.getsignal(signal.SIGINT) is theirs


def test_off_the_main_thread_the_block_runs_as_it_is(python_handler: None) -> None:
    seen: list[Any] = []

    def work() -> None:
        with held_interrupts():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


def test_an_error_in_the_block_goes_on_and_the_held_ctrl_c_with_it(python_handler: None) -> None:
    with pytest.raises(RuntimeError, match="the block's own"), held_interrupts():
        ctrl_c()
        raise RuntimeError("the block's own")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_settling_that_fails_after_a_ctrl_c_releases_the_record(
    monkeypatch: pytest.MonkeyPatch, python_handler: None
) -> None:
    with memlab.track("cpu"):
        pass
    monkeypatch.setattr(native_region, "HOLD_AFTER", 0)

    def failing(self: Any, *args: Any) -> Any:
        ctrl_c()
        raise RuntimeError("a settling that fails")

    monkeypatch.setattr(native_region.NativeRegion, "_settle", failing)
    with pytest.raises(RuntimeError, match="a settling that fails"), memlab.track("cpu"):
        torch.ones(10)
    monkeypatch.undo()
    with memlab.track("cpu") as again:  # released: the next region is native
        torch.ones(10)
    assert again._native is not None and again.report.peak_delta == 40
