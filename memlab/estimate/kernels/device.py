"""Meta kernels for the ops whose ``meta`` output is not what the CPU and CUDA kernels allocate.

- ``mish_backward`` and ``native_channel_shuffle`` have CPU and CUDA kernels (one output each)
  but no meta kernel, so on ``meta`` they run their ``CompositeImplicitAutograd`` formula, whose
  intermediate tensors (seven for ``mish_backward``) no device allocates. They are the only
  aten ops with a CPU kernel, a composite formula and no meta kernel (torch 2.13).
- ``mse_loss``, ``smooth_l1_loss``, ``binary_cross_entropy`` and ``soft_margin_loss`` reduced to a
  scalar compute the unreduced loss in their output and then shrink it (``resize_``), on the CPU
  and on CUDA alike: the scalar keeps a storage of the input's size for as long as the loss lives.
  PyTorch's meta kernels return a fresh 4-byte scalar.
- ``native_layer_norm_backward`` and ``_log_softmax_backward_data`` write the input's gradient
  into a contiguous tensor on the CPU and on CUDA (``empty_like`` of the contiguous input;
  ``LEGACY_CONTIGUOUS_MEMORY_FORMAT``); their meta kernels follow a strided gradient's layout
  (a LayerNorm over a transposed convolution's output: Swin, SegFormer, Wav2Vec2, ConvNeXt),
  and the ``view`` that follows in backward then copies it on meta alone.
- ``convolution``: meta returns a contiguous output where the CPU's and cuDNN's kernels return
  a channels-last one (`memlab.estimate.kernels.layout`).

Found by tests/test_estimate_sweep.py, which holds a meta run to a real CPU run layer by layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memlab.core import _torch
from memlab.core._torch import OwnedMode
from memlab.estimate.kernels import layout
from memlab.estimate.kernels.grouped import grouped_mm_kernels

aten = torch.ops.aten
NONE = 0  # torch's Reduction::None


def _reduced(input: torch.Tensor, target: torch.Tensor, reduction: int = 1, *_: Any) -> Any:
    """The loss as the CPU and CUDA kernels return it: reduced in place in a buffer of the
    (broadcast) input's size, which the scalar keeps."""
    out = input.new_empty(torch.broadcast_shapes(input.shape, target.shape))
    return out if reduction == NONE else out.resize_(())


def _smooth_l1(
    input: torch.Tensor, target: torch.Tensor, reduction: int = 1, beta: float = 1.0
) -> Any:
    if beta == 0 and reduction != NONE:  # the kernel calls l1_loss: a fresh scalar
        return input.new_empty(())
    return _reduced(input, target, reduction)


def _bce(input: torch.Tensor, target: torch.Tensor, weight: Any = None, reduction: int = 1) -> Any:
    return _reduced(input, target, reduction)


def _layer_norm_backward(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    shape: Any,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mask: Any,
) -> Any:
    """The input's gradient contiguous and first, then the weight's and the bias's as meta
    makes them (the order of the devices' kernels)."""
    dx = torch.empty(input.shape, dtype=input.dtype, device=input.device) if mask[0] else None
    rest = aten.native_layer_norm_backward.default(
        grad_out, input, shape, mean, rstd, weight, bias, [False, mask[1], mask[2]]
    )
    return dx, rest[1], rest[2]


def _log_softmax_backward(
    grad: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: torch.dtype
) -> Any:
    half = grad.dtype == torch.float32 and input_dtype == torch.float16  # CUDA's half_to_float
    return torch.empty(grad.shape, dtype=input_dtype if half else grad.dtype, device=grad.device)


def _mish_backward(grad_output: torch.Tensor, input: torch.Tensor) -> Any:
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _channel_shuffle(input: torch.Tensor, groups: int) -> Any:
    return torch.empty_like(input)


KERNELS: dict[Any, Callable[..., Any]] = {
    aten.mse_loss.default: _reduced,
    aten.smooth_l1_loss.default: _smooth_l1,
    aten.binary_cross_entropy.default: _bce,
    aten.soft_margin_loss.default: _reduced,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    _torch.log_softmax_backward.default: _log_softmax_backward,
}
#: The ops whose meta call runs their composite formula: a dispatch mode never sees them.
COMPOSITE = {"mish_backward": _mish_backward, "native_channel_shuffle": _channel_shuffle}
#: Meta kernels replaced beneath every mode (the modes above still see the op: cuDNN's
#: workspaces, the accounting): a convolution's output layout (`layout`).
REPLACED = {"convolution": layout.convolution}


class DeviceKernels(OwnedMode):
    """On ``meta``, the ops above allocate what their CPU and CUDA kernels allocate."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kernel = KERNELS.get(func)
        first = args[0] if args else None
        if kernel is not None and isinstance(first, torch.Tensor) and first.is_meta:
            return kernel(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def device_kernels() -> Iterator[None]:
    """Within the block, on ``meta``: the ops above as a device allocates them, and MoE experts'
    grouped products in every dtype, as CUDA takes them (`grouped_mm_kernels`). On whatever
    the kernel emulations (``cuda_kernels``) say: the CPU's kernels allocate the same."""
    library = torch.library.Library("aten", "IMPL")
    try:
        for name, kernel in (COMPOSITE | REPLACED).items():
            _torch.impl_over_composite(library, name, kernel, "Meta")
        with grouped_mm_kernels(), DeviceKernels():
            yield
    finally:
        _torch.destroy_library(library)  # the composite formulas are back
