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


def test_a_card_in_decimal_gigabytes_is_named_as_written_with_its_gib() -> None:
    card = parse("24GB")
    assert card.memory == 24 * 10**9
    assert card.describe() == "custom 24 GB (22.35 GiB)"
    assert parse("24GiB").describe() == "custom 24 GiB" and parse("24GiB").memory == 24 * GiB
    assert parse("T4").describe() == "T4 (16 GiB)"


def _saved_bytes(params: Any, *outputs: torch.Tensor) -> int:
    """Bytes of the storages the outputs' graphs saved for backward (each storage once), the
    parameters' aside (a weight saved as its transpose is the parameter's storage)."""
    from memlab.graphs.saved import saved_tensors

    weights = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}
    stack = [o.grad_fn for o in outputs]
    nodes: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in nodes:
            continue
        nodes.add(id(node))
        for _, t in saved_tensors(node):
            st = t.untyped_storage()
            if st.data_ptr() not in weights:
                seen[st.data_ptr()] = st.nbytes()
        stack.extend(f for f, _ in node.next_functions)
    return sum(seen.values())


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("first", ["-q", "-q -b"])
def test_a_live_graph_from_an_earlier_cell_is_activation_whatever_its_cell_s_flags(
    ip: Any, monkeypatch: pytest.MonkeyPatch, native: str, first: str
) -> None:
    monkeypatch.setenv("MEMLAB_NATIVE", native)
    setup = (
        "torch.manual_seed(0)\n"
        "net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), "
        "torch.nn.Linear(64, 64))\n"
        "x = torch.randn(32, 64)"
    )
    assert run(ip, setup).success
    assert run(ip, f"%%gpumem {first}\ny1 = net(x)").success
    assert run(ip, "%%gpumem -q -b\ny2 = net(x)").success
    assert run(ip, "%%gpumem -q -b -o later\nz = 1").success
    at_end = ip.user_ns["later"].breakdown.at_end
    y1, y2 = ip.user_ns["y1"], ip.user_ns["y2"]
    # x (read by both first layers) and each ReLU's output: saved, whichever cell made them
    params = ip.user_ns["net"].parameters()
    assert at_end[Category.ACTIVATION] == _saved_bytes(params, y1, y2) == 3 * 32 * 64 * 4
    assert at_end[Category.OTHER] == y1.untyped_storage().nbytes() + y2.untyped_storage().nbytes()


def test_a_graph_released_by_backward_costs_one_node_and_nothing_is_marked(ip: Any) -> None:
    setup = (
        "net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(200)])\n"
        "loss = net(torch.randn(4, 16)).sum()\nloss.backward()"
    )
    assert run(ip, setup).success
    assert run(ip, "%%gpumem -q -b -o r\nz = 1").success
    assert Category.ACTIVATION not in ip.user_ns["r"].breakdown.at_end
