"""The outermost module call of a native breakdown region: the global pre-hook steps out while it
runs (the calls inside keep PyTorch's fast path), and what that must not change: the phases, the
roles of the modules inside it, and what is left on the models after (`memlab.core.native.outer`).
Each case is measured natively and with the dispatch mode, which sees every call, and the two
must agree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_native_breakdown import check_path, figures_of, installed, phases_of, track, use
from torch import nn
from torch.nn.modules import module as nn_module

from memlab.core.categories import Category
from memlab.core.native import unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no native record here")


class Probe(nn.Module):
    """Writes down how many global forward pre-hooks are in while it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(len(nn_module._global_forward_pre_hooks))
        return x * 2


def test_the_calls_inside_the_outermost_one_run_without_a_global_hook() -> None:
    inner = Probe()
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(inner))
    x = torch.randn(2, 4)
    before = installed(model)
    with track() as t:
        model(x)
        inner(x)  # an outermost call of its own: the pre-hook is back after the first
    check_path(t, True)
    assert inner.seen == [0, 0]  # (inside the outermost call, and as one: the hook stepped out)
    after = installed(model)
    assert after == before
    assert all(not m._forward_pre_hooks for m in model.modules())  # nothing of ours left


class Recurses(nn.Module):
    """Calls itself once, then runs ops after the inner call returned (still its forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, again: bool = True) -> torch.Tensor:
        y = self(x, again=False) if again else x
        return self.lin(y) * 3


class ClearsHooks(nn.Linear):
    """Empties its forward-hook dict during its forward (the same dict, its keys gone)."""

    def __init__(self) -> None:
        super().__init__(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._forward_hooks.clear()
        return super().forward(x) + 1


class ThenAnother(nn.Module):
    """A module whose hooks are cleared, then one called after it inside the same forward."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = ClearsHooks(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


@pytest.mark.parametrize("make", [Recurses, ThenAnother])
def test_phases_equal_the_dispatch_modes_when_the_outermost_call_is_unusual(
    make: Callable[[], nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = phases_of(False, monkeypatch, make)
    fast = phases_of(True, monkeypatch, make)
    assert fast == slow
    assert {p for _, p in fast[-2]} >= {"forward", "other"}


def test_an_outermost_call_that_clears_its_own_hooks_leaves_nothing_of_ours_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (its end goes unseen, as it does for a module that replaces its hook dict: the ops
    # after it count as its forward until the next module call; see `Outer`)
    fast = phases_of(True, monkeypatch, ClearsHooks)
    assert fast[0] == 0 and fast[1] == 0  # nothing of ours on it, inside the region or after
    assert {p for _, p in fast[-2]} >= {"forward", "backward"}


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


class Deep(nn.Module):
    """Buffers and parameters two and three levels down, one block shared."""

    def __init__(self) -> None:
        super().__init__()
        shared = Block(4)
        self.blocks = nn.ModuleList([Block(3), nn.Sequential(shared), shared])
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        for block in self.blocks[1:]:
            x = block(x)
        return self.head(x.flatten(1))


def _deep_step(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, int]]:
    use(native_on, monkeypatch)
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 3, 6, 6)
    for _ in range(2):  # the second region: everything in it named before
        with track() as t:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    check_path(t, native_on)
    sizes = {
        "buffers": sum(b.untyped_storage().nbytes() for b in model.buffers()),
        "parameters": sum(p.untyped_storage().nbytes() for p in model.parameters()),
    }
    return figures_of(t), sizes


def test_buffers_and_parameters_deep_in_the_model_keep_their_roles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow, sizes = _deep_step(False, monkeypatch)
    fast, same = _deep_step(True, monkeypatch)
    assert same == sizes
    # (the categories and totals; the timelines of a convolution differ by route, as
    # test_native_breakdown's `runs` allows for)
    assert (fast.at_peak, fast.at_end, fast.totals) == (slow.at_peak, slow.at_end, slow.totals)
    assert fast.at_end[Category.BUFFER] == sizes["buffers"]
    assert fast.at_end[Category.PARAMETER] == sizes["parameters"]
