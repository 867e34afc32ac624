"""Convolutions on meta lay their output out as the CPU's kernels do (channels-last in,
channels-last out), so a channels-last model's estimate makes the copies a device makes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from memlab.estimate import estimate
from memlab.estimate.kernels.device import device_kernels
from memlab.whatif import RunConfig, StepHooks, run

CL, CL3 = torch.channels_last, torch.channels_last_3d


def _x(shape: tuple[int, ...], fmt: Any = None) -> Callable[[str], torch.Tensor]:
    def make(device: str) -> torch.Tensor:
        torch.manual_seed(0)
        t = torch.randn(shape, device=device)
        return t.contiguous(memory_format=fmt) if fmt is not None else t

    return make


#: (input, weight, keyword arguments, transposed): each run on the CPU and on meta.
CALLS: dict[str, tuple[Any, Any, dict[str, Any], bool]] = {
    "cl-input": (_x((2, 3, 9, 9), CL), _x((8, 3, 3, 3)), {"padding": 1}, False),
    "cl-weight": (_x((2, 3, 9, 9)), _x((8, 3, 3, 3), CL), {"stride": 2}, False),
    "plain": (_x((2, 3, 9, 9)), _x((8, 3, 3, 3)), {"dilation": 2}, False),
    "grouped": (_x((2, 4, 7, 5), CL), _x((6, 2, 3, 1)), {"groups": 2, "padding": (1, 0)}, False),
    "depthwise": (_x((2, 4, 8, 8), CL), _x((4, 1, 3, 3)), {"groups": 4, "padding": 1}, False),
    "pointwise": (_x((2, 4, 6, 6), CL), _x((5, 4, 1, 1)), {}, False),
    "one-channel": (_x((2, 1, 6, 6), CL), _x((4, 1, 3, 3)), {}, False),
    "same": (_x((2, 3, 8, 8), CL), _x((4, 3, 3, 3)), {"padding": "same"}, False),
    "unbatched": (_x((3, 9, 9)), _x((8, 3, 3, 3)), {"padding": 1}, False),
    "cl3d": (_x((2, 3, 4, 6, 6), CL3), _x((4, 3, 3, 3, 3)), {"padding": 1}, False),
    "conv1d": (_x((2, 3, 10)), _x((4, 3, 3)), {"stride": 2}, False),
    "transposed": (
        _x((2, 4, 5, 5), CL),
        _x((4, 6, 3, 3)),
        {"stride": 2, "output_padding": 1},
        True,
    ),
    "transposed-grouped": (
        _x((2, 4, 5, 5), CL),
        _x((4, 3, 2, 2)),
        {"stride": 2, "groups": 2, "dilation": 2, "padding": 1},
        True,
    ),
}


@pytest.mark.parametrize("name", CALLS)
def test_meta_convolutions_lay_out_their_output_as_the_cpu_does(name: str) -> None:
    make_x, make_w, kwargs, transposed = CALLS[name]
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[make_w("cpu").dim()]
    if transposed:
        conv = {4: F.conv_transpose2d}[make_w("cpu").dim()]
    cpu = conv(make_x("cpu"), make_w("cpu"), **kwargs)
    with device_kernels():
        meta = conv(make_x("meta"), make_w("meta"), **kwargs)
    assert (meta.shape, meta.stride()) == (cpu.shape, cpu.stride()), name
    outside = conv(make_x("meta"), make_w("meta"), **kwargs)  # PyTorch's own meta kernel again
    assert outside.shape == cpu.shape and outside.is_contiguous()


def test_float64_stays_contiguous_as_cudnn_runs_it() -> None:
    x = torch.randn(2, 3, 8, 8, device="meta", dtype=torch.float64).contiguous(memory_format=CL)
    with device_kernels():
        out = F.conv2d(x, torch.randn(4, 3, 3, 3, device="meta", dtype=torch.float64))
    assert out.is_contiguous()


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ConvTranspose2d(8, 4, 2, stride=2),
        nn.Flatten(),  # a channels-last output is copied here on a device
        nn.Linear(4 * 8 * 8, 10),
    )
    return model.to(memory_format=CL)


def _images(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 8).contiguous(memory_format=CL)


@pytest.mark.parametrize("mode", [{"mode": "no_grad"}, {"optimizer": "sgd"}])
def test_a_channels_last_models_estimate_counts_what_a_cpu_run_counts(mode: dict[str, Any]) -> None:
    config = RunConfig(batch_size=4, **mode)
    predicted = estimate(
        _cnn, _images, None, config, gpu=None, workspace=0, cuda_kernels=False
    ).tensors
    real = run(_cnn, _images, None, config.with_(device="cpu"), hooks=StepHooks(foreach=True))
    assert real.report is not None
    assert predicted.peak_allocated == real.report.peak_allocated
    assert predicted.allocated_after == real.report.allocated_after
