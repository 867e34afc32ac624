"""8-bit optimizer state in bitsandbytes' Adam8bit layout: its bytes against the formula worked
from the model's own parameter counts (two uint8 states per element and a float32 scale per
block of 256 for a parameter of 4,096 elements or more, two float32 states otherwise, and two
shared code books of 256 float32)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.step import RunConfig, WhatIfError
from memlab.step.adam8bit import Adam8bit
from memlab.whatif import run


def model() -> nn.Module:
    torch.manual_seed(0)
    # sizes that leave a partial block of 256 (1000 x 2049) and parameters under 4,096 elements
    return nn.Sequential(nn.Linear(256, 1000), nn.ReLU(), nn.Linear(1000, 2049), nn.Linear(2049, 8))


def inputs(n: int) -> torch.Tensor:
    return torch.randn(n, 256)


def expected(m: nn.Module) -> int:
    total = 2 * 256 * 4  # the two code books, shared by every parameter
    for p in m.parameters():
        n = p.numel()
        total += 2 * n + 2 * 4 * math.ceil(n / 256) if n >= 4096 else 2 * 4 * n
    return total


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_the_state_has_bitsandbytes_bytes(optimizer: str) -> None:
    config = RunConfig(device="cpu", batch_size=16, optimizer=optimizer)
    full = run(model, inputs, config=config).report
    eight = run(model, inputs, config=config.with_(optimizer_state_bits=8)).report
    assert full is not None and eight is not None
    assert full.breakdown is not None and eight.breakdown is not None
    numel = sum(p.numel() for p in model().parameters())
    assert full.breakdown.at_end[Category.OPTIMIZER_STATE] >= 2 * 4 * numel
    assert eight.breakdown.at_end[Category.OPTIMIZER_STATE] == expected(model())
    assert eight.peak_allocated < full.peak_allocated
    assert any("bitsandbytes" in n and "needs CUDA" in n for n in eight.notes)


def test_the_estimate_counts_the_same_bytes() -> None:
    e = estimate(model, inputs, batch_size=16, gpu="T4", optimizer_state_bits=8)
    assert e.tensors.breakdown is not None
    assert e.tensors.breakdown.at_end[Category.OPTIMIZER_STATE] == expected(model())
    assert any("Adam8bit layout" in n for n in e.report.notes)
    assert "8-bit optimizer state" in e.config.describe()


def test_the_8_bit_update_follows_adam() -> None:
    torch.manual_seed(0)
    a = torch.randn(5001, requires_grad=True)  # a partial last block
    b = a.detach().clone().requires_grad_(True)
    reference, eight = torch.optim.Adam([a], lr=1e-2), Adam8bit([b], lr=1e-2)
    start = float((a.detach() ** 2).sum())
    for _ in range(100):
        for opt, x in ((reference, a), (eight, b)):
            opt.zero_grad()
            (x**2).sum().backward()
            opt.step()
    # both descend the same bowl to about the same place
    assert float((b.detach() ** 2).sum()) < start / 2
    assert abs(b.norm().item() - a.norm().item()) < 0.05 * a.norm().item()


def test_bad_values_are_refused() -> None:
    with pytest.raises(WhatIfError, match="32 or 8"):
        RunConfig(optimizer_state_bits=4)
    with pytest.raises(WhatIfError, match="'adam' or 'adamw'"):
        RunConfig(optimizer_state_bits=8, optimizer="sgd_momentum")


def test_the_panel_toggle() -> None:
    import memlab

    ex = memlab.Explorer(model, inputs, config=RunConfig(device="cpu", batch_size=8))
    assert ex.config.optimizer_state_bits == 32
    ex.optimizer_state_bits.value = True
    assert ex.config.optimizer_state_bits == 8
    ex.optimizer_state_bits.value = False
    assert ex.config.optimizer_state_bits == 32


def test_the_update_works_a_chunk_at_a_time() -> None:
    """The update's float32 temporaries are bounded by a chunk, not by the parameter; on meta
    only a parameter's first and last chunks run, and the step allocates as on the CPU."""
    from memlab import track
    from memlab.step.adam8bit import CHUNK, state_bytes

    n = 4 * CHUNK + 700  # four whole chunks and a partial one, with a partial block
    temporaries = {}
    for device in ("cpu", "meta"):
        p = torch.zeros(n, device=device, requires_grad=True)
        p.grad = torch.ones(n, device=device)
        opt = Adam8bit([p])
        with track(device) as t:
            opt.step()
        r = t.report
        assert r.allocated_after - r.allocated_before == state_bytes([n])
        temporaries[device] = r.peak_allocated - r.allocated_after
    # four float32 chunks (the gradient, m, v and the denominator) and the blocks' scales,
    # where the whole gradient, m and v in float32 would be three copies of the parameter
    assert 0 < temporaries["cpu"] <= 4 * 4 * CHUNK + 4 * 4 * CHUNK // 256 < 3 * 4 * n
    assert temporaries["meta"] == temporaries["cpu"]
