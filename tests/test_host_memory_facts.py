"""What docs/host-memory.md says PyTorch does with host memory, checked where this machine can
check it (a CPU-only torch runs the CPU branch; a CUDA torch the other), not asserted in prose."""

from __future__ import annotations

import contextlib

import pytest
import torch

from memlab.region import track

MIB = 1 << 20


def test_pinned_memory_needs_an_accelerator() -> None:
    t = torch.ones(4)
    assert not t.is_pinned()  # an ordinary CPU tensor is pageable
    if torch.cuda.is_available():
        assert torch.empty(4, pin_memory=True).is_pinned()
        assert t.pin_memory().is_pinned()
        return
    # (a CPU build says it cannot pin; a CUDA build on a machine without a GPU, no driver)
    with pytest.raises(RuntimeError, match=r"pin|NVIDIA driver"):
        torch.empty(4, pin_memory=True)
    with pytest.raises(RuntimeError):
        t.pin_memory()


def test_a_non_blocking_copy_to_the_same_device_is_no_copy() -> None:
    t = torch.ones(4)
    assert t.to("cpu", non_blocking=True) is t


def _saved_bytes(ctx: contextlib.AbstractContextManager[object]) -> tuple[int, torch.Tensor]:
    x = torch.randn(MIB // 4, requires_grad=True)
    with ctx, track("cpu") as region:
        y = (x * x).sum()  # mul saves x twice (self and other)
    report = region.report
    return report.allocated_after - report.allocated_before, y


def test_save_on_cpu_copies_a_cpu_tensor_only_when_asked_to_pin() -> None:
    plain, y0 = _saved_bytes(contextlib.nullcontext())
    kept, y1 = _saved_bytes(torch.autograd.graph.save_on_cpu(pin_memory=False))
    pinned, y2 = _saved_bytes(torch.autograd.graph.save_on_cpu(pin_memory=True))
    assert kept == plain  # .cpu() of a CPU tensor is the tensor: nothing is copied
    if torch.cuda.is_available():
        return  # there the pinned copies are pinned host memory, not this device's
    # pin_memory=True makes a (pageable, since pinning is impossible) copy of every saved
    # tensor, even on the CPU: the two saves of x, 1 MiB each
    assert pinned - plain == 2 * MIB
    for y in (y0, y1, y2):
        y.backward()  # the packed copies come back for backward
