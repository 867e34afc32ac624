"""A Ctrl-C (or the caller's own BaseException) during the panel's work on the main thread: the
exception reaches the caller, and the status line says the work stopped instead of showing its
last progress ("trying 8 ...") as if it went on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memlab


@pytest.mark.parametrize("work", ["largest batch", "run"])
def test_the_status_says_the_work_stopped(work: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    calls = [0]

    def step(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == (3 if work == "largest batch" else 1):
            raise KeyboardInterrupt
        return m(batch).square().mean()

    panel = memlab.Explorer(
        lambda: model,
        lambda k: torch.randn(k, 64),
        step_fn=step,
        config={"budget": 64 * 2**20, "device": "cpu"},
    )
    with pytest.raises(KeyboardInterrupt):
        panel.largest_batch() if work == "largest batch" else panel.run()
    assert "stopped: KeyboardInterrupt" in panel.message
    assert "trying" not in panel.message
    assert panel.run() is not None  # the panel works on
