"""Convolutions' output layout on ``meta``, as the CPU's and cuDNN's kernels choose it.

PyTorch's meta kernel for ``aten.convolution`` always returns a contiguous output: a meta
tensor has no device, so it cannot tell which backend would run. The backends a training step
meets agree, though: oneDNN on the CPU and cuDNN on CUDA return a channels-last output when the
input or the weight is channels-last (``suggest_memory_format``; 4-D for ``channels_last``,
5-D for ``channels_last_3d``), except for float64, which cuDNN runs contiguous. A model moved
to channels-last (``model.to(memory_format=torch.channels_last)``) otherwise costs the estimate
copies no device makes, and misses the ones it does (a ``flatten`` after a channels-last
convolution copies on the devices, not on meta). The backward's meta kernel already follows the
same rule, so only the forward is replaced (`device_kernels` registers it for meta).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def suggested(t: torch.Tensor) -> torch.memory_format:
    """``suggest_memory_format``: channels-last where the strides are channels-last and not
    also plain contiguous (a tensor both, as one with a single channel, is contiguous)."""
    fmt = _FORMATS.get(t.dim())
    if fmt is None or t.is_contiguous() or not t.is_contiguous(memory_format=fmt):
        return torch.contiguous_format
    return fmt


def output_format(x: torch.Tensor, w: torch.Tensor) -> torch.memory_format:
    fmt = _FORMATS.get(w.dim())
    if fmt is None or x.dim() != w.dim() or torch.float64 in (x.dtype, w.dtype):
        return torch.contiguous_format
    return fmt if fmt in (suggested(x), suggested(w)) else torch.contiguous_format


def _each(v: Sequence[int], n: int) -> list[int]:
    return list(v) * n if len(v) == 1 else list(v)


def convolution(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: Any,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """``aten.convolution``'s output on meta: its shape as PyTorch's meta kernel computes it,
    laid out as `output_format` says."""
    n = w.dim() - 2
    size = x.shape[-n:]
    s, p, d = _each(stride, n), _each(padding, n), _each(dilation, n)
    k = w.shape[2:]
    if transposed:
        op = _each(output_padding, n)
        dims = [(size[i] - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + op[i] + 1 for i in range(n)]
        channels = w.shape[1] * groups
    else:
        dims = [(size[i] + 2 * p[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(n)]
        channels = w.shape[0]
    batch = list(x.shape[:1]) if x.dim() == w.dim() else []
    shape = [*batch, channels, *dims]
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=output_format(x, w))
