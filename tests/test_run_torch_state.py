"""A what-if run puts back what the user's step changed of torch's own state, as
docs/reliability.md says: the default dtype and the grad mode (the step_fn's
``torch.set_default_dtype(torch.float64)``, ``torch.set_grad_enabled(False)``), also where the
run fails; what the step left alone stays as the notebook had it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import memlab
from memlab.step.config import WhatIfError


@pytest.fixture(autouse=True)
def as_it_was() -> Iterator[None]:
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    yield
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)


def test_a_step_that_changes_the_default_dtype_leaves_it_as_it_was() -> None:
    def step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        torch.set_default_dtype(torch.float64)
        return model(batch.float()).sum()

    r = memlab.whatif.run(lambda: nn.Linear(8, 8), lambda n: torch.randn(n, 8), step_fn=step)
    assert r.report.peak_allocated > 0
    assert torch.get_default_dtype() == torch.float32


def test_a_step_that_turns_grad_off_fails_and_leaves_grad_on() -> None:
    def step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        torch.set_grad_enabled(False)
        return model(batch).sum()

    with pytest.raises(WhatIfError, match="does not require grad"):
        memlab.whatif.run(lambda: nn.Linear(8, 8), lambda n: torch.randn(n, 8), step_fn=step)
    assert torch.is_grad_enabled()


def test_the_notebooks_own_setting_is_kept() -> None:
    torch.set_default_dtype(torch.float64)
    memlab.whatif.run(lambda: nn.Linear(8, 8), lambda n: torch.randn(n, 8))
    assert torch.get_default_dtype() == torch.float64
