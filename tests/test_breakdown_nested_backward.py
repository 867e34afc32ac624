"""A backward inside a backward, and a backward that raised: the breakdown names the same
gradients on the native record (both its routes) as on the dispatch mode.

A reentrant checkpoint (``use_reentrant=True``, what Hugging Face's gradient checkpointing
used by default) runs its segment's forward again inside the outer backward, on inputs it
detaches, and a backward of its own through them. Those detached inputs are leaves whose
``.grad`` is handed back to the outer backward as its temporary, and is gone by its end: no
parameter's gradient. A backward that raised never runs the callback queued at its end; the next
backward must still name its gradients when it ends (the optimizer's step and the peak after it
read them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_native_record import ROUTES
from torch import nn
from torch.utils.checkpoint import checkpoint

import memlab
from memlab import Category
from memlab.core import native

pytestmark = pytest.mark.skipif(native.too_old() is not None, reason=str(native.too_old()))

WIDTH, BATCH = 256, 64
GRADS = 4 * (WIDTH * WIDTH + WIDTH) * 4  # the four layers' weights and biases, float32


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(4)])


def reentrant(m: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        h = m[0](x)
        for block in m[1:]:
            h = checkpoint(block, h, use_reentrant=True)
        h.square().mean().backward()
        for p in m.parameters():  # (the gradients' bytes, read at the peak: freed after)
            p.grad = None

    return step


def raised_then_again(m: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def refuse(g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("refused by the test")

    def step() -> None:
        y = m(x)
        y.register_hook(refuse)
        with pytest.raises(RuntimeError, match="refused by the test"):
            y.square().mean().backward()
        m(x).square().mean().backward()  # a backward of its own, after the one that raised
        big = torch.empty(8 * GRADS, dtype=torch.uint8)  # the peak, with the gradients alive
        del big
        for p in m.parameters():
            p.grad = None

    return step


STEPS = {"reentrant-checkpoint": reentrant, "raised-then-another": raised_then_again}


def breakdown(name: str, native_on: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("MEMLAB_NATIVE", "1" if native_on else "0")
    m, x = model(), torch.randn(BATCH, WIDTH)
    step = STEPS[name](m, x)
    step()
    with memlab.track("cpu", breakdown=True) as t:
        step()
    assert (t._native is not None) == native_on
    return t.report


@pytest.mark.parametrize("route", ROUTES, indirect=True)
@pytest.mark.parametrize("name", sorted(STEPS))
def test_gradients_are_named_as_the_dispatch_mode_names_them(
    name: str, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = breakdown(name, False, monkeypatch)
    fast = breakdown(name, True, monkeypatch)
    for r in (slow, fast):
        b = r.breakdown
        assert b is not None
        # the parameters' gradients, against the test's own count: no detached input's
        assert b.at_peak.get(Category.GRADIENT, 0) == GRADS, (name, dict(b.at_peak))
        assert b.highest.get(Category.GRADIENT, 0) == GRADS, (name, dict(b.highest))
    assert fast.peak_allocated == slow.peak_allocated
    assert dict(fast.breakdown.at_peak) == dict(slow.breakdown.at_peak)
    assert dict(fast.breakdown.highest) == dict(slow.breakdown.highest)
    assert dict(fast.breakdown.at_end) == dict(slow.breakdown.at_end)
