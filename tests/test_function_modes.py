"""A program's own torch function mode (a TorchFunctionMode that counts or logs the calls it
sees) sees the program's calls only: memlab's reads of the program's modules, optimizers and
tensors (their storages, addresses, gradients) while it measures are not the program's."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import memlab


class Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def workload() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 4)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    step()  # (the optimizer's state made: every later step is alike)
    return step, model


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "dispatch-mode"])
@pytest.mark.parametrize("breakdown", [False, True], ids=["plain", "breakdown"])
def test_a_function_mode_sees_the_same_calls_with_memlab_measuring(
    monkeypatch: pytest.MonkeyPatch, native: str, breakdown: bool
) -> None:
    monkeypatch.setenv("MEMLAB_NATIVE", native)
    step, model = workload()
    alone = Counting()
    with alone:
        step()
    measured = Counting()
    with measured, memlab.track("cpu", breakdown=breakdown, watch=[model]) as t:
        step()
    assert measured.seen == alone.seen, measured.seen - alone.seen
    assert (t._native is not None) == (native == "1")
    assert t.report.breakdown is not None or not breakdown


def test_a_function_mode_left_on_across_cells_sees_only_the_cells(ip: Any) -> None:
    """The magic looks at the notebook's variables at every cell (a model among them): with a
    mode the user entered in an earlier cell, a measured cell shows it the same calls."""
    ip.push({"Counting": Counting, "workload": workload})
    assert ip.run_cell("step, model = workload()\nmode = Counting()\nmode.__enter__()").success
    try:
        for magic in ("", "%%gpumem -q\n", "%%gpumem -q -b\n"):
            assert ip.run_cell("mode.seen.clear()").success
            assert ip.run_cell(f"{magic}step()").success
            seen = dict(ip.user_ns["mode"].seen)
            if not magic:
                alone = seen
            assert seen == alone, (magic, seen)
    finally:
        ip.run_cell("mode.__exit__(None, None, None)")
