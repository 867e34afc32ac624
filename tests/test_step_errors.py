"""A step's bad input gets a memlab error that names the argument, what it got and what to
pass; a run leaves the user's model, gradients included, as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memlab.estimate import estimate
from memlab.whatif import RunConfig, WhatIfError, run


def rows(b: int) -> torch.Tensor:
    return torch.randn(b, 8)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # needs the values: not on meta
            return self.lin(x)
        return self.lin(-x)


class ReturnsNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> None:
        self.lin(x)


def test_data_dependent_code_on_meta_names_the_user_s_line() -> None:
    with pytest.raises(WhatIfError, match=r"test_step_errors.py, line \d+: if x.sum\(\) > 0"):
        estimate(Branchy, rows, gpu="T4", batch_size=4)


def test_item_in_the_input_function_on_meta_is_explained() -> None:
    def ids(b: int) -> torch.Tensor:
        n = int(torch.randint(1, 5, ()).item())
        return torch.randn(b, 8) * n

    with pytest.raises(WhatIfError, match=r"needs a tensor's values.*n = int"):
        estimate(lambda: nn.Linear(8, 8), ids, gpu="T4")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be a whole number ≥ 1, not 0"),
        ({"batchsize": 4}, "'batchsize' is not a setting of a step: pass one of accumulation"),
        ({"config": "bf16"}, "config must be a memlab.whatif.RunConfig .* not str 'bf16'"),
        ({"config": {"amp": "fp8"}}, "amp='fp8' is not one of 'off', 'fp16', 'bf16'"),
        ({"config": {"ampp": "bf16"}}, "'ampp' is not a setting of a step"),
        ({"amp": "bf16", "checkpoint": "all"}, "checkpoint='all' is not one of 'off', 'auto'"),
    ],
)
def test_bad_settings_name_the_argument(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(WhatIfError, match=message):
        run(lambda: nn.Linear(8, 8), rows, device="cpu", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(WhatIfError, match=message):
        estimate(lambda: nn.Linear(8, 8), rows, gpu="T4", **kwargs)  # type: ignore[arg-type]


def test_settings_as_keywords_and_as_a_dict_are_the_config() -> None:
    a = run(lambda: nn.Linear(8, 8), rows, device="cpu", batch_size=4, optimizer="sgd")
    b = run(
        lambda: nn.Linear(8, 8), rows, config={"device": "cpu", "batch_size": 4, "optimizer": "sgd"}
    )
    assert a.config == b.config == RunConfig(device="cpu", batch_size=4, optimizer="sgd")
    assert a.peak == b.peak


def test_a_forward_that_returns_none_says_what_to_do() -> None:
    with pytest.raises(WhatIfError, match="forward returned NoneType, which holds no tensor"):
        run(ReturnsNone, rows, device="cpu")


@pytest.mark.parametrize("value", [3, 2.5, "text"])
def test_a_forward_that_returns_a_number_says_what_to_do(value: object) -> None:
    class Odd(nn.Linear):
        def forward(self, x: torch.Tensor) -> object:  # type: ignore[override]
            super().forward(x)
            return value

    with pytest.raises(WhatIfError, match=f"forward returned {type(value).__name__}"):
        run(lambda: Odd(8, 8), rows, device="cpu")


def test_a_loss_without_grad_says_why() -> None:
    with pytest.raises(WhatIfError, match="loss does not require grad"):
        run(lambda: nn.Linear(8, 8), rows, lambda out: out.detach().sum(), device="cpu")


def test_a_run_on_the_user_s_model_leaves_its_gradients_untouched() -> None:
    model = nn.Linear(8, 8)
    model(torch.randn(2, 8)).sum().backward()
    assert model.weight.grad is not None
    grad = model.weight.grad
    before = grad.clone()
    weights = model.weight.detach().clone()
    run(lambda: model, rows, device="cpu", optimizer="sgd")
    assert model.weight.grad is grad and torch.equal(grad, before)  # same object, same values
    assert torch.equal(model.weight.detach(), weights)


def test_a_lazy_module_not_yet_run_is_named_with_how_to_materialise_it() -> None:
    def lazy() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def rows(b: int) -> torch.Tensor:
        return torch.randn(b, 8)

    expected = r"uninitialized lazy parameter\(s\) \('0.weight' first.*m\(input_fn\(1\)\)"
    with pytest.raises(WhatIfError, match=expected):
        run(lazy, rows, lambda o: o.sum(), RunConfig(device="cpu", batch_size=4))
    with pytest.raises(WhatIfError, match=expected):
        estimate(lazy, rows, lambda o: o.sum(), batch_size=4, gpu=None)

    def materialised() -> torch.nn.Module:
        m = lazy()
        m(rows(1))
        return m

    params = 4 * (8 * 16 + 16 + 16 * 4 + 4)  # the shapes the first forward gave
    done = run(materialised, rows, lambda o: o.sum(), RunConfig(device="cpu", batch_size=4))
    assert done.report is not None
    assert done.report.breakdown.at_end["parameter"] == params
    predicted = estimate(materialised, rows, lambda o: o.sum(), batch_size=4, gpu=None)
    assert predicted.report.breakdown.at_end["parameter"] == params
