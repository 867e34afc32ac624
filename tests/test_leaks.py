"""memlab must not grow: 400 tracked cells later its own memory is where it was (less than a KiB a
cell; the soak in a real kernel, tests/test_soak.py, holds 900 cells to 64 KiB in all)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from conftest import NOTHING_INSTALLED, hooks_installed, run

import memlab
from memlab.core.ledger import default_ledger

MEMLAB_DIR = str(Path(memlab.__file__).parent)
CELLS = 400


def memlab_bytes() -> int:
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, MEMLAB_DIR + "/*")])
    return sum(s.size for s in snap.statistics("filename"))


@pytest.mark.slow
@pytest.mark.parametrize("options", ["-q", "-q -b -o last"])
def test_hundreds_of_tracked_cells_leave_memlab_no_bigger(ip: Any, options: str) -> None:
    cell = f"%%gpumem {options}\nx = torch.ones(1000) * 2\ny = x + 1\ndel x"
    for _ in range(50):  # warm-up: first-use caches, interned strings
        assert run(ip, cell).success
    ip._memlab_magics.history.clear()
    tracemalloc.start(5)
    try:
        before = memlab_bytes()
        ledger_before = len(default_ledger())
        for _ in range(CELLS):
            run(ip, cell)
        grown = memlab_bytes() - before
        ledger_after = len(default_ledger())
    finally:
        tracemalloc.stop()
    assert grown <= CELLS * 1024, f"memlab's own memory grew by {grown:,} B over {CELLS:,} cells"
    assert ledger_after == ledger_before  # one live `y` at the end, as at the start
    assert hooks_installed() == NOTHING_INSTALLED


def test_regions_leave_no_reference_to_the_users_tensors() -> None:
    import gc
    import weakref

    import torch

    x = torch.empty(1000)
    ref = weakref.ref(x.untyped_storage())
    with memlab.track("cpu", breakdown=True, timeline=True, watch=[x]):
        y = x * 2
    del x, y
    gc.disable()
    try:
        assert ref() is None  # freed by refcount alone: no cycle through memlab
    finally:
        gc.enable()
