"""An optimizer that puts a new tensor into its state at every step (as Hugging Face's Adafactor
does): its state is optimizer state at every step's end, by the native record as by the
dispatch mode, and equals the bytes the state holds."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import memlab
from memlab.core import native


class Replacing(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["rms"] = p.abs().clone()  # a new tensor each step
                p.sub_(group["lr"] * p.grad)


@pytest.mark.parametrize("native_on", [True, False])
def test_a_state_tensor_replaced_each_step_stays_optimizer_state(
    native_on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if native_on and native.unavailable() is not None:
        pytest.skip(f"the native record is unavailable: {native.unavailable()}")
    monkeypatch.setenv("MEMLAB_NATIVE", "1" if native_on else "0")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = Replacing(model.parameters())
    x = torch.randn(4, 64)
    for _ in range(3):
        with memlab.track("cpu", breakdown=True) as t:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert (t._native is not None) == native_on
        held = sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values())
        r = t.report
        assert r.breakdown is not None
        assert held == (64 * 64 + 64) * 4
        assert r.breakdown.at_end.get(memlab.Category.OPTIMIZER_STATE, 0) == held
        assert r.breakdown.at_end.get(memlab.Category.OTHER, 0) == 0
