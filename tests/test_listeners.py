"""A ledger listener that raises (a bug of memlab's own) never starves the others: each still
hears every event, the failures are counted, and the regions open meanwhile say so."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import memlab
from memlab.core import native
from memlab.core.categories import Category
from memlab.core.ledger import Ledger, default_ledger
from memlab.core.native.frees import Frees


class Heard:
    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.events: list[tuple[str, int]] = []

    def on_alloc(self, serial: int, delta: int, when: float) -> None:
        self.events.append(("alloc", delta))

    def on_free(self, serial: int, nbytes: int, category: Category | None, when: float) -> None:
        self.events.append(("free", nbytes))

    def on_discovered(self, serial: int, nbytes: int) -> None:
        self.events.append(("discovered", nbytes))

    def on_mark(self, serial: int, category: Category) -> None:
        self.events.append(("mark", 0))

    def on_saved(self, serial: int, saved: bool) -> None:
        self.events.append(("saved", int(saved)))


class Broken(Heard):
    def on_alloc(self, serial: int, delta: int, when: float) -> None:
        raise RuntimeError("a listener's own bug")

    def on_free(self, serial: int, nbytes: int, category: Category | None, when: float) -> None:
        raise ValueError("and again")


def test_the_listeners_after_a_broken_one_still_hear_every_event() -> None:
    ledger = Ledger()
    broken, heard = Broken(), Heard()
    ledger.attach(broken)
    ledger.attach(heard)
    t = torch.empty(1000)
    ledger.produced(t, t.untyped_storage(), 0.0)
    nbytes = t.untyped_storage().nbytes()
    del t
    ledger.settle()
    assert heard.events == [("alloc", nbytes), ("free", nbytes)]
    assert ledger.failures == 2 and ledger.total("cpu") == 0
    assert ledger.failure_notes == [
        "Broken failed: RuntimeError: a listener's own bug",
        "Broken failed: ValueError: and again",
    ]


def test_a_region_keeps_its_figures_and_says_what_a_listener_lost() -> None:
    ledger = default_ledger()
    broken = Broken()
    ledger.attach(broken)
    try:
        with memlab.track("cpu", timeline=True) as t:
            x = torch.empty(2**18)  # 1 MiB
            del x
    finally:
        ledger.detach(broken)
    r: Any = t.report
    assert r.peak_delta == 2**20 and r.allocated_delta == 0  # the region's recorder heard both
    assert t.lost == 2
    assert any("2 event(s) not taken in by memlab's listeners" in n for n in r.notes), r.notes
    with memlab.track("cpu") as clean:
        y = torch.empty(10)
    assert clean.lost == 0 and clean.report.allocated_delta == y.untyped_storage().nbytes()


@pytest.mark.skipif(native.too_old() is not None, reason=str(native.too_old()))
@pytest.mark.parametrize("watched", [False, True], ids=["track", "watch-nothing"])
def test_a_native_region_says_what_its_own_listener_lost(
    monkeypatch: pytest.MonkeyPatch, watched: bool
) -> None:
    """The native record's listener (the frees of storages the ledger follows) is the region's
    own: where it raises, the region says so and counts it, watched or not (the magic's region
    watches the notebook, which often hands it nothing)."""
    with memlab.track("cpu"):
        x = torch.empty(2**18)  # followed by the ledger from here
    nbytes = x.untyped_storage().nbytes()

    def broken(*args: Any) -> None:
        raise RuntimeError("the record listener's own bug")

    monkeypatch.setattr(Frees, "on_free", broken)
    with memlab.track("cpu", watch=(lambda: []) if watched else ()) as t:
        del x
    assert t._native is not None and t._accountant is None  # (nothing watched: no accountant)
    assert t.lost == 1, t.report.notes
    assert [n for n in t.report.notes if "not taken in by memlab's listeners" in n] == [
        "1 event(s) not taken in by memlab's listeners (Frees failed: RuntimeError: the record "
        "listener's own bug)"
    ]
    assert t.report.allocated_delta == -nbytes  # (the ledger heard the free all the same)
    monkeypatch.undo()
    with memlab.track("cpu", watch=lambda: []) as clean:
        y = torch.empty(10)
    assert clean.lost == 0 and clean.report.allocated_delta == y.untyped_storage().nbytes()
