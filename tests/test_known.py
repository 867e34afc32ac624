"""A region without a breakdown only tells the ledger the storages behind the notebook's objects
(`memlab.core.known`), and passes over the model and optimizer it told already where the native
record saw nothing allocated outside what it followed since. Each figure is checked against the
bytes of the tensors the test made."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from conftest import run
from torch import nn

import memlab
from memlab.core import known, native
from memlab.core.ledger import Ledger, default_ledger

pytestmark = pytest.mark.skipif(
    native.unavailable() is not None, reason="the native record does not load here"
)


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from memlab.core import devices

    monkeypatch.setattr(devices, "_cuda_count", lambda: 0)


def _bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages behind ``tensors`` (the independent figure)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    return model, opt


def _everything(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return params + grads + list(model.buffers()) + state


def test_every_storage_behind_a_model_and_its_optimizer_is_told_once() -> None:
    model, opt = _trained()
    ledger = Ledger()
    assert known.make_known([model, opt], ledger) == []
    assert ledger.total("cpu") == _bytes(*_everything(model, opt))
    assert known.make_known([model, opt, model], ledger) == []  # told again: nothing changes
    assert ledger.total("cpu") == _bytes(*_everything(model, opt))


def test_a_module_that_raises_when_looked_at_is_skipped_and_said() -> None:
    class Broken(nn.Module):
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("no")

    broken = Broken.__new__(Broken)  # (no __init__: it has no _parameters)
    ledger = Ledger()
    t = torch.ones(10)
    notes = known.make_known([broken, t], ledger)
    assert notes == ["skipped 1 object(s) memlab could not inspect"]
    assert ledger.total("cpu") == 40  # the tensor after it is told all the same


def test_gradients_made_by_an_untracked_cell_count_when_a_tracked_cell_frees_them(
    ip: Any,
) -> None:
    run(ip, "model = torch.nn.Linear(100, 100)\nopt = torch.optim.SGD(model.parameters(), 0.1)")
    run(ip, "%%gpumem -q\nx = torch.ones(4, 100)")  # the model told the ledger
    run(ip, "model(x).sum().backward()")  # untracked: the gradients are new to the ledger
    grads = _bytes(*(p.grad for p in ip.user_ns["model"].parameters()))
    run(ip, "%%gpumem -q -o r\nopt.zero_grad(set_to_none=True)")
    assert ip.user_ns["r"].allocated_delta == -grads == -(100 * 100 + 100) * 4


def _told(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The kinds of the objects each region's `make_known` looked into, one list a region."""
    calls: list[list[str]] = []
    real = known._tensors_of

    def spy(obj: Any) -> Any:
        calls[-1].append(type(obj).__name__)
        return real(obj)

    original = known.make_known

    def each(*args: Any) -> Any:
        calls.append([])
        return original(*args)

    monkeypatch.setattr(known, "_tensors_of", spy)
    monkeypatch.setattr("memlab.region.measure.make_known", each)
    return calls


def test_the_model_is_looked_into_again_only_after_memory_was_made_outside_a_region(
    ip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _told(monkeypatch)
    run(ip, "model = torch.nn.Linear(10, 10)")
    run(ip, "%%gpumem -q\na = 1")  # first look: everything
    run(ip, "%%gpumem -q\nw = model(torch.ones(2, 10))")  # made in the region: followed
    run(ip, "%%gpumem -q\nb = 2")  # `w` is new: it alone is looked at
    run(ip, "z = torch.zeros(3)")  # untracked: memory made outside any region
    run(ip, "%%gpumem -q\nc = 3")
    assert calls == [["Linear"], [], ["Tensor"], ["Tensor", "Linear", "Tensor"]]


def test_memory_a_thread_made_during_a_region_makes_the_next_look_at_everything(
    ip: Any,
) -> None:
    """A thread started before the cell allocates while the region is open: the record does not
    follow it, so the next cell looks at the model again and counts the free of what it added."""
    model = ip.user_ns["model"] = nn.Linear(10, 10)
    go, done = threading.Event(), threading.Event()

    def grow() -> None:
        go.wait(10)
        model.extra = nn.Parameter(torch.ones(1000))
        done.set()

    worker = threading.Thread(target=grow)
    worker.start()
    ip.user_ns.update(go=go, done=done)
    run(ip, "%%gpumem -q\na = 1")
    run(ip, "%%gpumem -q\ngo.set()\ndone.wait(10)")
    worker.join(10)
    run(ip, "%%gpumem -q -o r\ndel model.extra")
    assert ip.user_ns["r"].allocated_delta == -4000


def test_without_the_native_record_every_object_is_told_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, opt = _trained()
    watch = known.Renewing()
    watch.told_at = 0
    monkeypatch.setattr(known, "library", lambda wait=True: None)
    ledger = Ledger()
    known.make_known([model, opt], ledger, watch)
    assert ledger.total("cpu") == _bytes(*_everything(model, opt))
    assert watch.told_at is None


def test_a_tracked_region_with_watch_and_no_breakdown_counts_a_watched_models_free() -> None:
    """`memlab.track(watch=...)` outside the magic: the model made before the region is told
    the ledger, so its free inside the region counts."""
    model, opt = _trained()
    held = _bytes(*_everything(model, opt))
    box = {"model": model, "opt": opt}
    del model, opt
    with memlab.track("cpu", watch=lambda: list(box.values())) as t:
        box.clear()
    assert t.report.allocated_before == held == -t.report.allocated_delta
    assert default_ledger().total("cpu") == 0


def test_a_breakdown_names_each_cells_gradients_new_replaced_or_moved(ip: Any) -> None:
    """The breakdown's watch names a gradient once while its tensor and memory stay (through the
    model and the optimizer, at the region's start and end); gradients made again by an
    untracked cell, and one whose memory was swapped (``.data =``), are named anew: the
    gradient category at the end is the bytes of the gradients alive, each time."""
    from memlab.core.categories import Category

    run(ip, "model = torch.nn.Linear(20, 30)\nopt = torch.optim.Adam(model.parameters())")
    run(ip, "model(torch.ones(2, 20)).sum().backward(); opt.step()")

    def gradients_at_end() -> tuple[int, int]:
        run(ip, "%%gpumem -q -b -o r\na = 1")
        breakdown = ip.user_ns["r"].breakdown
        grads = [p.grad for p in ip.user_ns["model"].parameters()]
        return breakdown.at_end.get(Category.GRADIENT, 0), _bytes(*grads)

    first = gradients_at_end()
    assert first[0] == first[1] == (20 * 30 + 30) * 4
    assert gradients_at_end() == first  # (named before: the same)
    run(ip, "opt.zero_grad(set_to_none=True)\nmodel(torch.ones(2, 20)).sum().backward()")
    assert gradients_at_end() == first  # new tensors, named again
    run(ip, "model.weight.grad.data = torch.ones(30, 40)")  # the same tensor, other memory
    got, truth = gradients_at_end()
    assert got == truth == (30 * 40 + 30) * 4
