"""Round 7 (newcomer and hostile): a run's figures whatever earlier runs were given, the
largest-batch search on a model that needs batch > 1, dataclass outputs, TorchScript models,
and restoring a model part by part."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import memlab
from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.step import leftovers
from memlab.step.restore import restored
from memlab.whatif import RunConfig, WhatIfError, run

CPU = RunConfig(device="cpu", batch_size=4)


def make() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def rows(n: int) -> torch.Tensor:
    return torch.randn(n, 32)


def figures(r: memlab.whatif.RunResult) -> tuple[int | None, int]:
    assert r.report is not None and r.report.breakdown is not None
    return r.peak, r.report.breakdown.at_peak[Category.PARAMETER]


@pytest.fixture
def no_earlier_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No models given to other tests' runs."""
    monkeypatch.setattr(leftovers, "GIVEN", weakref.WeakSet())
    yield


# -- newcomer 2: a model the user keeps, given to an earlier run -----------------------------------
class WithUnused(nn.Module):
    """A model with a layer its forward never uses: its parameters are the model's all the
    same."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(32, 8), nn.Linear(100, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out


@pytest.mark.usefixtures("no_earlier_runs")
def test_a_model_the_user_keeps_is_not_counted_in_later_runs() -> None:
    params = sum(p.nbytes for p in make().parameters())  # the truth, by hand
    before = run(make, rows, None, CPU)
    mine = make()
    run(lambda: mine, rows, None, CPU)  # the README's use: the user's own model
    after = run(make, rows, None, CPU)
    assert figures(before) == figures(after)
    assert figures(after)[1] == params
    assert after.report is not None
    assert not any("earlier runs" in n for n in after.report.notes)
    # the user's own model measured again: all of its parameters, though the ledger knew them
    other = WithUnused()
    run(lambda: other, rows, None, CPU)
    again = run(lambda: other, rows, None, CPU)  # beside `mine`, which a run was given
    assert figures(again)[1] == sum(p.nbytes for p in other.parameters())
    assert figures(run(lambda: mine, rows, None, CPU)) == figures(before)


# -- newcomer 3: the largest-batch search on a model that needs batch > 1 --------------------------
def batch_normed() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32))


def test_the_search_starts_at_a_batch_the_model_takes() -> None:
    ex = memlab.Explorer(batch_normed, rows, config=CPU.with_(batch_size=8))
    ex.budget.value = 0.1  # MiB
    best = ex.largest_batch()
    assert best is not None and best > 2, ex.message
    budget = int(0.1 * 1024**2)
    assert not run(batch_normed, rows, None, CPU.with_(batch_size=best, budget=budget)).oom
    assert run(batch_normed, rows, None, CPU.with_(batch_size=best + 1, budget=budget)).oom
    assert "batch 1 raised ValueError: Expected more than 1 value per channel" in ex.message
    assert "the search started at 2" in ex.message


def test_a_batch_the_search_chose_that_raises_is_named() -> None:
    wrong = memlab.Explorer(batch_normed, lambda n: torch.randn(n, 31), config=CPU)
    wrong.budget.value = 1
    assert wrong.largest_batch() is None
    assert wrong.message.startswith("the search for the largest batch tried batch 1 first")
    assert "mat1 and mat2 shapes cannot be multiplied" in wrong.message


# -- newcomer 4: a forward that returns a dataclass ------------------------------------------------
@dataclasses.dataclass
class Out:
    logits: torch.Tensor


class Returns(nn.Module):
    def __init__(self, as_dataclass: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(32, 64)
        self.as_dataclass = as_dataclass

    def forward(self, x: torch.Tensor) -> Out | tuple[torch.Tensor]:
        y = self.layer(x).relu()
        return Out(y) if self.as_dataclass else (y,)


@pytest.mark.parametrize("retention", ["off", "detached"])
def test_a_dataclass_output_is_unpacked_as_a_tuple_is(retention: str) -> None:
    config = CPU.with_(retention=retention, batch_size=16)
    dc = run(lambda: Returns(True), rows, None, config)
    tup = run(lambda: Returns(False), rows, None, config)
    assert dc.report is not None and tup.report is not None
    assert dc.peak == tup.peak
    assert dc.report.breakdown == tup.report.breakdown


# -- hostile 2: TorchScript models -----------------------------------------------------------------
def test_a_torchscript_model_is_refused_before_anything_runs() -> None:
    scripted = torch.jit.script(make())
    weights = [p.detach().clone() for p in scripted.parameters()]
    for attempt in (
        lambda: run(lambda: scripted, rows, None, CPU),
        lambda: estimate(lambda: torch.jit.script(make()), rows, batch_size=4, gpu="T4"),
    ):
        with pytest.raises(WhatIfError) as e:
            attempt()
        said = str(e.value)
        assert said.startswith("model_fn returned a TorchScript module (RecursiveScriptModule")
        assert "as it was before torch.jit.script" in said
    assert all(torch.equal(a, b) for a, b in zip(weights, scripted.parameters(), strict=True))


def test_restoring_a_torchscript_model_puts_its_weights_back() -> None:
    scripted = torch.jit.script(make())
    weights = [p.detach().clone() for p in scripted.parameters()]
    with restored(scripted, weights=True), torch.no_grad():
        for p in scripted.parameters():
            p.add_(1.0)  # what an optimizer's step does
    assert all(torch.equal(a, b) for a, b in zip(weights, scripted.parameters(), strict=True))


class Refusing(set[str]):
    """A set that refuses to be trimmed: a part of the restore that fails."""

    def __iand__(self, other: object) -> Refusing:
        raise RuntimeError("this part cannot be put back")


def test_a_restore_that_fails_in_part_puts_the_values_and_gradients_back_first() -> None:
    model = nn.Linear(32, 8)
    model.weight.grad = torch.ones_like(model.weight)
    grad = model.weight.grad
    weights = [p.detach().clone() for p in model.parameters()]
    model._non_persistent_buffers_set = Refusing()
    with (
        pytest.raises(RuntimeError, match="cannot be put back"),
        restored(model, weights=True),
        torch.no_grad(),
    ):
        for p in model.parameters():
            p.add_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert model.weight.grad is grad
