"""The optimizer step fused into backward: one optimizer per parameter, stepped by a
post-accumulate-grad hook, the gradient freed at once. Checked against the test's own
parameter sizes: without the lever every gradient is alive at once; with it, only the one
being stepped and those its backward node produced with it (a Linear's weight and bias)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.step import RunConfig, WhatIfError
from memlab.whatif import run

SIZES = ((256, 1024), (1024, 2048), (2048, 256))


def model() -> nn.Module:
    torch.manual_seed(0)
    a, b, c = (nn.Linear(i, o) for i, o in SIZES)
    return nn.Sequential(a, nn.ReLU(), b, nn.ReLU(), c)


def inputs(n: int) -> torch.Tensor:
    return torch.randn(n, SIZES[0][0])


# float32: 4 bytes a parameter, a weight (in x out) and a bias (out) per layer
LAYER_BYTES = [4 * (i * o + o) for i, o in SIZES]
ALL_GRADS = sum(LAYER_BYTES)
LARGEST_WEIGHT = 4 * max(i * o for i, o in SIZES)


def test_the_gradients_are_never_all_alive_at_once() -> None:
    config = RunConfig(device="cpu", batch_size=16)
    plain = run(model, inputs, config=config).report
    fused = run(model, inputs, config=config.with_(optimizer_in_backward=True)).report
    assert plain is not None and fused is not None
    assert plain.breakdown is not None and fused.breakdown is not None
    assert plain.breakdown.highest[Category.GRADIENT] == ALL_GRADS
    most = fused.breakdown.highest[Category.GRADIENT]
    # the largest weight's gradient, and its bias's, which its node produced with it
    assert LARGEST_WEIGHT <= most <= max(LAYER_BYTES) < ALL_GRADS
    # the optimizer state is the same: Adam's two moments per parameter, and a step count each
    states = [plain.breakdown.highest[Category.OPTIMIZER_STATE]]
    states.append(fused.breakdown.highest[Category.OPTIMIZER_STATE])
    assert states[0] == states[1] >= 2 * ALL_GRADS
    assert fused.peak_allocated < plain.peak_allocated


def test_the_model_is_left_as_it_was() -> None:
    m = model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    run(lambda: m, inputs, config=RunConfig(device="cpu", batch_size=4, optimizer_in_backward=True))
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    m(inputs(2)).sum().backward()  # no hook left to step and free the gradients
    assert all(p.grad is not None for p in m.parameters())


def test_the_estimate_fuses_the_step_too() -> None:
    plain = estimate(model, inputs, batch_size=16, gpu="T4")
    fused = estimate(model, inputs, batch_size=16, gpu="T4", optimizer_in_backward=True)
    assert plain.tensors.breakdown is not None and fused.tensors.breakdown is not None
    assert plain.tensors.breakdown.highest[Category.GRADIENT] == ALL_GRADS
    assert fused.tensors.breakdown.highest[Category.GRADIENT] <= max(LAYER_BYTES)
    assert fused.report.peak_allocated < plain.report.peak_allocated
    assert "optimizer in backward" in fused.config.describe()


def test_it_refuses_what_it_cannot_do() -> None:
    with pytest.raises(WhatIfError, match="accumulation=1"):
        RunConfig(optimizer_in_backward=True, accumulation=2, batch_size=8)
    with pytest.raises(WhatIfError, match="fp16"):
        RunConfig(optimizer_in_backward=True, amp="fp16")
    with pytest.raises(WhatIfError, match="mode='no_grad' has no optimizer step"):
        RunConfig(optimizer_in_backward=True, mode="no_grad")


def test_the_panel_toggle() -> None:
    import memlab

    ex = memlab.Explorer(model, inputs, config=RunConfig(device="cpu", batch_size=16))
    ex.optimizer_in_backward.value = True
    r = ex.run()
    assert r is not None and r.config.optimizer_in_backward and r.report is not None
    assert r.report.breakdown is not None
    assert r.report.breakdown.highest[Category.GRADIENT] <= max(LAYER_BYTES)
