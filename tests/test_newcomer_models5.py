"""A newcomer's own models and habits (round 5): a model passed where a function that returns it
is asked for, an estimate's batch sliced from a dataset held on the CPU, ``--driver`` on a
machine without CUDA, and a card given in decimal gigabytes."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from conftest import run
from torch.nn import functional

import memlab
from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.estimate.gpus import GiB, parse
from memlab.step import WhatIfError


def _batch(n: int) -> torch.Tensor:
    return torch.randn(n, 8)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: memlab.whatif.run(m, _batch, batch_size=2),
        lambda m: memlab.Explorer(m, _batch),
    ],
    ids=["whatif.run", "Explorer"],
)
def test_a_model_passed_as_model_fn_says_to_pass_a_function(call: Any) -> None:
    model = torch.nn.Linear(8, 8)
    before = model.weight.detach().clone()
    with pytest.raises(WhatIfError, match=r"model_fn got a model already built \(Linear\)"):
        call(model)
    with pytest.raises(WhatIfError, match=r"model_fn=lambda: model"):
        call(model)
    assert torch.equal(model.weight, before)  # never called, never stepped
    with pytest.raises(WhatIfError, match=r"model_fn got int 3: pass a function"):
        call(3)


def test_lambda_model_still_runs() -> None:
    model = torch.nn.Linear(8, 8)
    r = memlab.whatif.run(lambda: model, _batch, batch_size=2)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert r.report.breakdown.at_end["parameter"] >= params


X = torch.randn(32, 3, 16, 16)
Y = torch.randint(0, 10, (32,))
P = collections.namedtuple("P", "x y")


def _cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 14 * 14, 10)
    )


def _step(m: torch.nn.Module, b: Any) -> torch.Tensor:
    x, y = (b["x"], b["y"]) if isinstance(b, dict) else (b[0], b[1])
    return functional.cross_entropy(m(x), y)


@pytest.mark.parametrize(
    "inputs",
    [
        lambda n: (X[:n], Y[:n]),
        lambda n: [X[:n], Y[:n]],
        lambda n: {"x": X[:n], "y": Y[:n]},
        lambda n: P(X[:n], Y[:n]),
    ],
    ids=["tuple", "list", "dict", "namedtuple"],
)
def test_an_estimate_takes_a_batch_sliced_from_a_dataset_on_the_cpu(inputs: Any) -> None:
    on_gpu = estimate(
        _cnn, lambda n: (X[:n].to("cuda"), Y[:n].to("cuda")), batch_size=8, step_fn=_step, gpu="T4"
    )
    from_cpu = estimate(_cnn, inputs, batch_size=8, step_fn=_step, gpu="T4")
    assert from_cpu.peak_allocated == on_gpu.peak_allocated > 0
    assert from_cpu.peak_reserved == on_gpu.peak_reserved
    breakdown = from_cpu.tensors.breakdown
    assert breakdown is not None and breakdown.at_peak[Category.INPUT] >= X[:8].nbytes


def test_driver_on_a_machine_without_cuda_is_said_not_dropped(ip: Any) -> None:
    with memlab.track("cpu", driver=True) as t:
        x = torch.ones(4)
    assert any("driver view: none for cpu" in n for n in t.report.notes), t.report.notes
    assert x.sum() == 4
    assert run(ip, "%%gpumem --driver -o r\ny = torch.ones(3)").success
    assert any("driver view" in n for n in ip.user_ns["r"].notes)


def test_a_card_in_gigabytes_is_named_as_written_and_holds_what_its_maker_means() -> None:
    card = parse("24GB")  # a "24GB" card holds 24 GiB, as the "A100 80GB" preset holds 80
    assert card.memory == 24 * GiB == parse("RTX 4090").memory
    assert parse("80GB").memory == parse("A100 80GB").memory
    assert card.describe() == "custom 24 GB (24 GiB)"
    assert parse("24GiB").describe() == "custom 24 GiB" and parse("24GiB").memory == 24 * GiB
    assert parse("T4").describe() == "T4 (16 GiB)"
