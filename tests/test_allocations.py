"""The allocation record (PyTorch's profiler memory events) against tensors the test makes."""

from __future__ import annotations

import pytest
import torch

import memlab
from memlab.core.allocations import AllocationRecord


def test_peak_and_net_are_the_bytes_of_the_tensors_made() -> None:
    a = torch.ones(1000)  # made before: not the region's
    with AllocationRecord() as rec:
        b = torch.empty(256, 256)  # 262,144 B, kept
        c = torch.empty(1000, dtype=torch.float64)  # 8,000 B, freed below
        del c
        d = a * 2  # 4,000 B, kept
    assert rec.result is not None
    assert rec.result.net == b.untyped_storage().nbytes() + d.untyped_storage().nbytes()
    assert rec.result.peak == 262_144 + 8_000
    # and a few bytes more: PyTorch wraps the Python number 2 in a tensor of its own
    assert [size for _, size, _ in rec.result.events if size > 64] == [262_144, 8_000, 4_000]
    assert rec.result.count >= 3


def test_agrees_with_tensor_accounting_on_a_training_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 64)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on
    with AllocationRecord() as rec:
        step()
    with memlab.track("cpu") as t:
        step()
    assert rec.result is not None
    # The allocator also sees the few-byte tensors PyTorch wraps Python numbers in (Adam's
    # scalars), which are no op's output: at most a handful of them live at once.
    assert 0 <= rec.result.peak - t.report.peak_delta <= 64
    assert rec.result.net == t.report.allocated_delta


def test_a_running_profiler_is_refused_and_left_running() -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with pytest.raises(RuntimeError, match="profiler is already running"), AllocationRecord():
            pass
        torch.ones(3).sum()
    assert any(e.name == "aten::sum" for e in prof.events())


def test_the_profiler_prints_nothing_to_the_process_stderr() -> None:
    """Its C++ side writes to file descriptor 2 (shown under a notebook cell): run in a child
    process whose stderr is a pipe, nothing arrives."""
    import subprocess
    import sys

    code = (
        "import torch\nfrom memlab.core.allocations import AllocationRecord\n"
        "with AllocationRecord() as r:\n    torch.ones(10)\n"
        "with AllocationRecord() as r:\n    torch.ones(10)\n"
        "import sys; print('after', file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stderr == "after\n"
