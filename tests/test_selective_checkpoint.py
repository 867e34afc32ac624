"""Selective activation checkpointing: checkpointed blocks keep their matrix products' outputs
and recompute the rest. What a forward leaves alive for backward lies between full
checkpointing and none, above full checkpointing by exactly the test's own count of the
matmul outputs (each block's two Linear outputs, batch x width float32)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memlab import track
from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.step import RunConfig, WhatIfError
from memlab.step.checkpoint import checkpointed
from memlab.step.levers import selective
from memlab.whatif import run

WIDTH, BATCH, BLOCKS = 256, 32, 4
TENSOR = BATCH * WIDTH * 4  # bytes of one (batch, width) float32 tensor

pytestmark = pytest.mark.skipif(
    not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"),
    reason="selective checkpointing is new in torch 2.5",
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(
            self.up(x)
        )  # pointwise ops, each saving a tensor when not recomputed
        h = h * torch.sigmoid(h)
        return torch.tanh(self.down(h))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)])


def inputs(n: int) -> torch.Tensor:
    return torch.randn(n, WIDTH)


def kept_by_forward(saves: str) -> int:
    """Bytes a forward leaves alive (its output included) under checkpoint='auto'."""
    m, x = model(), inputs(BATCH)
    config = RunConfig(checkpoint="auto" if saves != "none" else "off")
    if saves == "matmuls":
        config = config.with_(checkpoint_saves="matmuls")
    with checkpointed(m, config.checkpoint, selective(config)), track("cpu") as t:
        out = m(x)
    del out
    return t.report.allocated_after - t.report.allocated_before


def test_kept_bytes_lie_between_full_checkpointing_and_none() -> None:
    full, kept, none = (kept_by_forward(s) for s in ("full", "matmuls", "none"))
    # full checkpointing keeps each later block's input and the output
    assert full == BLOCKS * TENSOR
    # selective keeps, besides, the two Linear outputs of every block
    assert kept - full == BLOCKS * 2 * TENSOR
    assert full < kept < none


def test_a_training_step_and_its_estimate() -> None:
    # SGD, and a batch whose activations outweigh the weights: the step peaks where backward
    # starts, with what the forward kept
    base = RunConfig(device="cpu", batch_size=512, checkpoint="auto", optimizer="sgd")
    full = run(model, inputs, config=base).report
    kept = run(model, inputs, config=base.with_(checkpoint_saves="matmuls")).report
    plain = run(model, inputs, config=base.with_(checkpoint="off")).report
    assert full is not None and kept is not None and plain is not None
    assert full.peak_allocated < kept.peak_allocated < plain.peak_allocated
    e = estimate(model, inputs, config=base.with_(checkpoint_saves="matmuls"))
    ef = estimate(model, inputs, config=base)
    assert e.tensors.peak_allocated - ef.tensors.peak_allocated == (
        kept.peak_allocated - full.peak_allocated
    )
    assert "checkpoints keep matmuls" in e.config.describe()
    assert kept.breakdown is not None and kept.breakdown.highest[Category.PARAMETER] > 0


def test_it_needs_checkpointing() -> None:
    with pytest.raises(WhatIfError, match="checkpoint='auto'"):
        RunConfig(checkpoint_saves="matmuls")
    with pytest.raises(WhatIfError, match="'nothing'"):
        RunConfig(checkpoint="auto", checkpoint_saves="everything")


def test_the_panel_toggle() -> None:
    import memlab

    ex = memlab.Explorer(model, inputs, config=RunConfig(device="cpu", batch_size=8))
    ex.checkpoint.value = "auto"
    ex.checkpoint_saves.value = True
    assert ex.config.checkpoint_saves == "matmuls"
    r = ex.run()
    assert r is not None and r.report is not None and "keep matmuls" in r.config.describe()
