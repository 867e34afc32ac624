"""A search for the largest batch cancelled before its first step keeps what its first tries
measured: the batches they found to fit are the answer so far, never "not even a batch of 1
fits" (what the panel said when Cancel came during its first tries)."""

from __future__ import annotations

import torch
from torch import nn

import memlab


def test_a_search_cancelled_at_once_keeps_what_its_first_tries_found() -> None:
    ex = memlab.Explorer(
        lambda: nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)),
        lambda n: torch.randn(n, 64),
        config={"device": "cpu", "batch_size": 8},
    )
    ex.budget.value = 64  # MiB: batches 1 and 2 fit by far
    ex._work._stop.set()  # Cancel pressed before the search's first step
    best = ex.largest_batch()
    assert best is not None and best >= 1, best
    said = ex.status.value
    assert "not even a batch" not in said and "cancelled: the largest found so far" in said, said
    assert f": {best:,}" in said
