"""What a native region hears from the ledger while it is open (`memlab.core.native.region`):
the frees of storages the ledger followed before it, and the storages it finds (read, marked,
resized) that existed all along."""

from __future__ import annotations

from typing import cast

import torch

from memlab.core.categories import Category
from memlab.core.ledger import Ledger

_CPU = "cpu"


class _OnCpu:
    """Stands for a tensor where the ledger asks only for its device: the record hands over
    storages, not tensors."""

    device = torch.device("cpu")


ON_CPU = cast(torch.Tensor, _OnCpu())


class Frees:
    """Listens to the ledger for the region: the frees of storages it followed before."""

    device = _CPU

    def __init__(self, ledger: Ledger, first: int) -> None:
        self.ledger = ledger
        self.first = first
        self.freed: dict[int, int] = {}  # address -> bytes
        #: Address -> the role each of those had when freed (a breakdown's replay).
        self.freed_role: dict[int, Category | None] = {}
        self.unplaced = 0
        self.discovered = 0
        #: Serials of storages found during the region (counted in `before` as older memory),
        #: and their addresses then.
        self.found: set[int] = set()
        self.found_at: set[int] = set()

    def on_free(self, serial: int, nbytes: int, category: Category | None, when: float) -> None:
        if serial < self.first or serial in self.found:
            entry = self.ledger._by_serial.get(serial)
            if entry is not None and entry.ptr:
                self.freed[entry.ptr] = nbytes
                self.freed_role[entry.ptr] = category
            else:  # from before the wrapper: no place in its log (counted at the end)
                self.unplaced += nbytes

    def on_alloc(self, serial: int, delta: int, when: float) -> None:
        pass

    def on_discovered(self, serial: int, nbytes: int) -> None:
        # a storage from before the region, first seen now (read by an op, marked, resized):
        # it raises every figure of the region, its start included
        self.discovered += nbytes
        self.found.add(serial)
        entry = self.ledger._by_serial.get(serial)
        if entry is not None and entry.ptr:
            self.found_at.add(entry.ptr)

    def on_mark(self, serial: int, category: Category) -> None:
        pass

    def on_saved(self, serial: int, saved: bool) -> None:
        pass
