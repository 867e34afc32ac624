"""memlab removes only what it installed, and a Ctrl-C reaches the user's code with the ledger
right: the program's own dispatch modes and saved-tensor hooks, and interrupts while memlab
settles its books."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import memlab
from memlab.core import _torch
from memlab.core.categories import Category
from memlab.core.ledger import Ledger


class Counting(torch.utils._python_dispatch.TorchDispatchMode):  # the user's own mode
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def modes() -> list[Any]:
    return _torch.dispatch_mode_stack()


@pytest.fixture(autouse=True)
def clean_stack() -> Any:
    assert modes() == []
    yield
    while modes():  # a failed test must not leave modes on for the next
        torch.utils._python_dispatch._pop_mode()


def test_a_mode_entered_in_the_region_and_left_on_stays_on() -> None:
    mine = Counting()
    with memlab.track("cpu", breakdown=True) as t:
        x = torch.ones(1000)
        mine.__enter__()
        y = x * 2
    assert modes() == [mine]  # the user's mode, not memlab's
    assert any("left on: Counting" in n for n in t.report.notes)
    before = mine.ops
    z = y + 1
    assert mine.ops == before + 1  # still counting
    mine.__exit__(None, None, None)
    assert modes() == []
    del z


def test_a_mode_on_before_the_region_and_exited_in_it_is_the_one_removed() -> None:
    mine = Counting()
    mine.__enter__()
    with memlab.track("cpu") as t:
        a = torch.ones(256)
        mine.__exit__(None, None, None)  # pops the top mode: must be the user's
        b = torch.ones(256)
    assert modes() == []
    assert t.report.peak_allocated >= 2 * 1024  # memlab still saw both tensors
    assert not t.report.notes
    del a, b


def test_a_mode_on_across_the_region_is_left_where_it_was() -> None:
    mine = Counting()
    with mine:
        with memlab.track("cpu", breakdown=True) as t:
            x = torch.ones(10) * 3
        assert modes() == [mine]
        assert mine.ops >= 2 and not t.report.notes
    assert modes() == []
    del x


def test_the_program_s_saved_tensor_hooks_stay_in_force() -> None:
    packed: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.numel())
        return t

    lin = torch.nn.Linear(8, 8)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with memlab.track("cpu", breakdown=True) as t:
            out = lin(torch.randn(4, 8, requires_grad=True)).sum()
        assert packed, "memlab replaced the program's hooks"
        top = _torch.saved_tensors_hooks_on()
        assert top is not None and top[0] is pack
    assert any("own saved_tensors_hooks" in n for n in t.report.notes)
    del out


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_pair_memlab_left_in_force_is_taken_off_not_taken_for_the_program_s(
    monkeypatch: pytest.MonkeyPatch, native: str
) -> None:
    """memlab's pair left in force by a region that closed (inside backward: the autograd
    engine puts back the thread's state it saved, the pair with it; or on another thread):
    the next region takes it off and tags what is saved as any region does."""
    monkeypatch.setenv("MEMLAB_NATIVE", native)
    with memlab.track("cpu", breakdown=True):
        pair = _torch.saved_tensors_hooks_on()
    if pair is None:
        pytest.skip("this PyTorch cannot say which saved-tensor hooks are in force (2.4)")
    _torch.push_saved_tensors_hooks(*pair)  # (as the engine leaves it)
    lin = torch.nn.Linear(64, 64)
    try:
        with memlab.track("cpu", breakdown=True) as t:
            out = lin(torch.randn(32, 64, requires_grad=True)).relu().sum()
        assert _torch.saved_tensors_hooks_on() is None
    finally:
        _torch.remove_saved_tensors_hooks(pair[0])  # (where it failed: no pair for the next)
    assert not any("saved_tensors_hooks" in n for n in t.report.notes), t.report.notes
    breakdown = t.report.breakdown
    assert breakdown is not None and breakdown.at_end[Category.ACTIVATION] >= 32 * 64 * 4
    del out


def test_saved_tensor_hooks_entered_in_the_region_and_left_on_stay_on() -> None:
    lin = torch.nn.Linear(8, 8)
    theirs = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with memlab.track("cpu", breakdown=True):
        theirs.__enter__()
        out = lin(torch.randn(4, 8, requires_grad=True)).sum()
    top = _torch.saved_tensors_hooks_on()
    assert top is not None and top[0] is theirs.pack_hook
    theirs.__exit__()
    assert _torch.saved_tensors_hooks_on() is None  # memlab's own are gone too
    del out


def test_memlab_s_free_callback_runs_no_python_code() -> None:
    """A weak reference's callback that runs Python can be hit by Ctrl-C, which Python then
    prints as "Exception ignored" and drops: the user's loop goes on. memlab's only queues."""
    ledger = Ledger()
    t = torch.ones(10)
    entry = ledger.existing(t, t.untyped_storage())
    callback = entry.ref.__callback__
    assert type(callback).__name__ == "builtin_function_or_method"
    del t


class Interrupting:
    """A listener that is interrupted (as by Ctrl-C) the first time it hears of a free."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[int] = []
        self.armed = True

    def on_alloc(self, serial: int, delta: int, when: float) -> None: ...
    def on_discovered(self, serial: int, nbytes: int) -> None: ...
    def on_mark(self, serial: int, category: Category) -> None: ...
    def on_saved(self, serial: int, saved: bool) -> None: ...

    def on_free(self, serial: int, nbytes: int, category: Category | None, when: float) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        self.freed.append(nbytes)


def test_an_interrupt_while_settling_finishes_the_books_then_reaches_the_caller() -> None:
    ledger = Ledger()
    listener = Interrupting()
    ledger.attach(listener)
    tensors = [torch.ones(n) for n in (10, 20, 30)]
    for t in tensors:
        ledger.produced(t, t.untyped_storage(), 0.0)
    assert ledger.total("cpu") == 240
    del t
    tensors.clear()  # three frees queued
    with pytest.raises(KeyboardInterrupt):
        ledger.total("cpu")
    assert ledger.total("cpu") == 0 and len(ledger) == 0  # every free taken, once
    assert sorted(listener.freed) == [40, 80, 120]  # the interrupted one told again, once


def test_an_event_half_logged_when_ctrl_c_came_does_not_break_the_report() -> None:
    from memlab.core.recorder import Recorder

    ledger = Ledger()
    rec = Recorder(ledger, "cpu", True, lambda: 0)
    rec.start()
    t = torch.ones(10)
    ledger.produced(t, t.untyped_storage(), 0.0)
    rec._serials.append(99)  # as if interrupted between the event arrays' appends
    tally = rec.tally(breakdown=True)
    rec.stop()
    assert tally.totals is not None and list(tally.totals) == [40]
    del t
