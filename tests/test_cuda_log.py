"""On a GPU: a breakdown read from the caching allocator's log (`memlab.core.cuda_log`) against
the allocator's own counters and against the dispatch mode's breakdown of the same step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import memlab
from memlab import Category
from memlab.core import _torch, cuda_claim

pytestmark = pytest.mark.cuda


def convnet() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(64 * 16, 10),
    ).cuda()
    opt = torch.optim.Adam(model.parameters())
    return model, opt, torch.randn(32, 3, 64, 64, device="cuda")


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def breakdown_of(model: Any, opt: Any, x: Any, log: bool, monkeypatch: Any) -> Any:
    monkeypatch.setenv(cuda_claim.ENV, "1" if log else "0")
    with memlab.track("cuda", breakdown=True) as t:
        step(model, opt, x)
    assert (t._log is not None) == log
    return t.report


def test_the_log_adds_up_to_the_allocator_and_agrees_with_the_dispatch_mode(
    monkeypatch: Any,
) -> None:
    model, opt, x = convnet()
    step(model, opt, x)  # Adam's state and cuDNN's choices made before
    torch.cuda.synchronize()
    via_log = breakdown_of(model, opt, x, True, monkeypatch)
    via_mode = breakdown_of(model, opt, x, False, monkeypatch)
    b = via_log.breakdown
    assert b is not None and via_mode.breakdown is not None
    # at the end the blocks are read from the allocator itself: nothing is left unattributed
    assert b.at_end.get(Category.UNATTRIBUTED, 0) == 0
    assert sum(b.at_end.values()) == via_log.allocated_after == torch.cuda.memory_allocated()
    assert sum(b.at_peak.values()) == via_log.peak_allocated
    assert 0 <= b.at_peak[Category.UNATTRIBUTED] <= via_log.peak_allocated // 100
    blocks = 512 * 64  # at most 511 B of rounding per block, and fewer than 64 blocks a role
    # (the two peaks can fall at different moments: the log sees cuDNN's workspaces, which can
    # make a moment of backward the highest; each role's own highest is the same moment's)
    for role in (Category.ACTIVATION, Category.GRADIENT, Category.INPUT):
        mode = via_mode.breakdown.highest.get(role, 0)
        assert 0 <= b.highest.get(role, 0) - mode <= blocks, role
    for role in (Category.PARAMETER, Category.OPTIMIZER_STATE, Category.BUFFER):
        mode = via_mode.breakdown.at_end.get(role, 0)
        assert 0 <= b.at_end.get(role, 0) - mode <= blocks, role
    assert b.highest[Category.ACTIVATION] > 32 * 64 * 64 * 64 * 4  # the second conv's output


def test_history_hooks_and_an_exception_leave_nothing_behind(monkeypatch: Any) -> None:
    from torch.nn.modules import module as nn_module

    model, _, x = convnet()
    hooks = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    with pytest.raises(ValueError, match="mine"), memlab.track("cuda", breakdown=True) as t:
        model(x).sum().backward()
        raise ValueError("mine")
    assert t._log is not None and t.report.breakdown is not None
    assert t.report.breakdown.at_peak[Category.ACTIVATION] > 0
    assert not torch._C._cuda_isHistoryEnabled()
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == hooks
    assert _torch.saved_tensors_hooks_on() is None


def test_the_programs_own_history_is_left_alone() -> None:
    model, opt, x = convnet()
    torch.cuda.memory._record_memory_history(context=None, max_entries=100_000)
    try:
        with memlab.track("cuda", breakdown=True) as t:
            step(model, opt, x)
        assert t._log is None  # the dispatch mode measured
        assert t.report.breakdown is not None
        assert torch._C._cuda_isHistoryEnabled()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_a_timeline_or_nested_region_is_measured_as_before() -> None:
    model, opt, x = convnet()
    with memlab.track("cuda", breakdown=True, timeline=True) as t:
        step(model, opt, x)
    assert t._log is None and t.report.timeline is not None
    with (
        memlab.track("cuda", breakdown=True) as outer,
        memlab.track("cuda", breakdown=True) as inner,
    ):
        step(model, opt, x)
    assert outer._log is not None and inner._log is None
    assert outer.report.breakdown is not None and inner.report.breakdown is not None
    # the inner region's pack hook makes its aliases with the outer log's: both see the saving
    assert inner.report.breakdown.at_peak[Category.ACTIVATION] > 0
    assert outer.report.breakdown.at_peak[Category.ACTIVATION] > 0


def test_the_magic_reads_the_log(ip: Any) -> None:
    from conftest import run

    run(ip, "import torch\nm = torch.nn.Linear(256, 256).cuda()")
    run(ip, "opt = torch.optim.SGD(m.parameters(), lr=0.1)")
    run(
        ip, "%%gpumem -b -o rb\nm(torch.randn(64, 256, device='cuda')).sum().backward()\nopt.step()"
    )
    r = ip.user_ns["rb"]
    assert r.breakdown is not None
    params = 256 * 256 * 4 + 256 * 4  # (whole blocks of 512 B: the allocator's own sizes)
    assert r.breakdown.at_end[Category.PARAMETER] == params
    assert r.breakdown.at_end[Category.GRADIENT] == params


def test_a_backward_in_the_cell_after_its_forward_frees_activations() -> None:
    model, _, x = convnet()
    with memlab.track("cuda", breakdown=True) as fwd:
        y = model(x).square().mean()
    assert fwd._log is not None
    saved = fwd.report.breakdown.at_end[Category.ACTIVATION]  # type: ignore[union-attr]
    assert saved > 32 * 64 * 64 * 64 * 4
    with memlab.track("cuda", breakdown=True, watch=lambda: [y]) as bwd:
        y.backward()
    b = bwd.report.breakdown
    assert bwd._log is not None and b is not None
    # what the earlier cell's graph saved is counted an activation until backward frees it
    assert b.highest[Category.ACTIVATION] >= saved
    assert b.at_end.get(Category.ACTIVATION, 0) < saved // 10


def test_a_cache_of_ones_own_is_named_by_mark() -> None:
    # keys and values a program's own loop keeps in a list: named in the allocator's log
    with memlab.track("cuda", breakdown=True) as t:
        cache = [torch.randn(4, 2, 64, 32, device="cuda") for _ in range(4)]
        for x in cache:
            memlab.mark(x, "kv_cache")
    b = t.report.breakdown
    assert b is not None
    assert b.at_end[Category.KV_CACHE] == sum(x.untyped_storage().nbytes() for x in cache)
