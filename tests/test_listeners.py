"""A ledger listener that raises (a bug of memlab's own) never starves the others: each still
hears every event, the failures are counted, and the regions open meanwhile say so."""

from __future__ import annotations

from typing import Any

import torch

import memlab
from memlab.core.categories import Category
from memlab.core.ledger import Ledger, default_ledger


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
