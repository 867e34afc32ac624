"""cuDNN's convolutions on a GPU: the workspace each call takes, for the call's duration, after
its outputs. `CudaAllocations` (`modes.py`) hands ``aten.convolution`` and its backward here.

The size is the algorithm's that cuDNN picks on the card, read from the recorded traces by
the kind of convolution (`_kind`): a 1x1 convolution with stride 1, no padding, no dilation
and one group is a matrix product over channels, with no im2col buffer
(`pointwise_workspace`); one with a stride, ResNet's downsampling shortcut, has rules of its
own for the forward and backward-data calls (`strided_pointwise_workspace`); every other
convolution follows `conv_workspace`; depthwise ones take none. Where the traces do not
settle a size it is a range (`memlab.estimate.spread`). Which recorded runs each rule rests
on: docs/estimator.md, "cuDNN convolution workspaces".

A GPU's backward makes the input's gradient and its workspace before the weight's gradient
(``cudnn_convolution_backward`` in ATen's ``cudnn/ConvShared.cpp``); here both gradients come
first, as the meta kernel makes them (docs/estimator.md, "Known limitations")."""

from __future__ import annotations

from typing import Any

import torch

from memlab.estimate.spread import uncertain_empty

aten = torch.ops.aten


def conv_workspace(a: int, b: int, weight: int, of_weights: bool) -> tuple[int, int, int]:
    """(predicted, smallest, largest) workspace of one cuDNN convolution call: ``a`` and ``b``
    the bytes of the activations it reads and writes (forward: input and output; backward data:
    the output's and the input's gradients; backward weights: the input and the output's
    gradient), ``weight`` the weight's bytes.

    Read from the ResNet-18 and ResNet-50 traces on an H100 (cuDNN 9, tests/data/validation):
    the usual forward and backward-data workspace is both activations and the weight (+16 B),
    the range a quarter either way; the backward-weights workspace is that sum and up to 40 %
    more (1.2 times, predicted). Some calls pick an algorithm outside these ranges (the input and
    the weight at 56 x 56 positions in float32, half the usual size; 1.3 to 1.5 times at 14 x
    14): docs/estimator.md, "cuDNN convolution workspaces"."""
    base = a + b + weight + 16
    if of_weights:
        return base * 6 // 5, base, base * 7 // 5
    return base, base * 3 // 4, base * 5 // 4


#: Positions per image (H x W) of a pointwise convolution at or below which cuDNN's forward and
#: backward-data calls were recorded to lay both activations out anew (a workspace of input and
#: output), and at or above which they ran the product in place (a few hundred bytes or none).
#: Between the two no run was recorded: a range holding both.
POINTWISE_LAID_OUT, POINTWISE_IN_PLACE = 49, 196
#: Positions per image at or above which the backward-weights call was recorded to split the
#: product's reduction into `SLICES` partial weight gradients in float32.
POINTWISE_SPLIT = 784
SLICES = 32
#: The in-place product's workspace: 400 B in float32 (some calls none; none in 16 bits).
TINY = 400


def pointwise_workspace(
    what: str, a: int, b: int, weight_elements: int, positions: int, itemsize: int
) -> tuple[int, int, int]:
    """(predicted, smallest, largest) workspace of one cuDNN call of a pointwise convolution:
    ``what`` "forward", "backward data" or "backward weights"; ``a`` and ``b`` the activations'
    bytes (as `conv_workspace`), ``positions`` H x W of one image, ``itemsize`` the activations'.

    Read from torchvision's ResNet-50 (batch 32, H100, cuDNN 9: the only recorded network with
    such convolutions; tests/data/validation): forward and backward data take 400 B or none
    from 196 positions up, both activations (+16 B) at 49; backward weights take 32 float32
    partial weight gradients from 784 positions up, both activations (+16 B) at 49, and in 16
    bits at 196 (in float32 at 196: the partials, or once 1.2 times the activations). Where no
    run was recorded the range holds both choices."""
    laid_out = a + b + 16
    if what == "backward weights":
        split = SLICES * weight_elements * 4
        if positions <= POINTWISE_LAID_OUT:
            return laid_out, laid_out, laid_out
        if positions >= POINTWISE_SPLIT:
            return split, split, split
        guess = laid_out if itemsize < 4 else split  # as recorded at 196 positions
        return guess, min(laid_out, split), max(laid_out, split)
    if positions <= POINTWISE_LAID_OUT:
        return laid_out, laid_out, laid_out
    if positions >= POINTWISE_IN_PLACE:
        return TINY, TINY, TINY
    middle = POINTWISE_LAID_OUT * 2  # the geometric middle of 49 and 196 positions
    return (laid_out if positions < middle else TINY), TINY, laid_out


#: Positions per image of an input (56 x 56, the most recorded) from which cuDNN's float32
#: forward calls were recorded to take the input and the weight, not the output.
LARGE_INPUT = 3136


def strided_pointwise_workspace(
    a: int, b: int, weight: int, positions: int, itemsize: int, what: str
) -> tuple[int, int, int]:
    """(predicted, smallest, largest) workspace of a forward or backward-data call of a 1x1
    convolution with a stride (ResNet's downsampling shortcut), in the terms of
    `conv_workspace`, ``positions`` H x W of one image of ``a``; its backward-weights call
    follows `conv_workspace`.

    Read from ResNet-18's three and ResNet-50's three (H100, cuDNN 9, every recorded dtype):
    they take both activations without the weight (+16 to 147 B), but in float32 forward
    from `LARGE_INPUT` positions, where ResNet-50's took the input and the weight, as both
    networks' 3x3 convolutions at 56 x 56 mostly do (ResNet-18's took none). The range: the
    input and the smaller of output and weight, to `conv_workspace`'s largest."""
    low, high = a + min(b, weight) + 16, conv_workspace(a, b, weight, False)[2]
    if what == "forward" and itemsize == 4 and positions >= LARGE_INPUT:
        return a + weight + 16, low, high
    return a + b + 16, low, high


def forward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``aten.convolution`` as cuDNN runs it: the output, then the call's workspace."""
    out = func(*args, **kwargs)
    x, w, groups = args[0], args[1], args[8]
    if not _depthwise(x, groups):
        _workspace(x, out, w, "forward", _kind(w, args[3], args[4], args[5], args[6], groups))
    return out


def backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``aten.convolution_backward`` with cuDNN's workspaces: backward data's, then backward
    weights', each freed at once, after both gradients."""
    out = func(*args, **kwargs)
    grad, x, w = args[0], args[1], args[2]
    groups, mask = args[9], args[10]
    if _depthwise(x, groups):
        return out
    kind = _kind(w, args[4], args[5], args[6], args[7], groups)
    if mask[0] and out[0] is not None:
        _workspace(grad, out[0], w, "backward data", kind)
    if mask[1]:
        _workspace(x, grad, w, "backward weights", kind)
    return out


def _workspace(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, what: str, kind: str) -> None:
    """Allocates and frees the workspace of one call, by the convolution's ``kind``."""
    cause = "aten.convolution: cuDNN workspace"
    size = conv_workspace(_bytes(a), _bytes(b), _bytes(w), what == "backward weights")
    positions, itemsize = _positions(a), a.element_size()
    if kind == "strided 1x1" and what != "backward weights":
        size = strided_pointwise_workspace(
            _bytes(a), _bytes(b), _bytes(w), positions, itemsize, what
        )
        cause += " of a strided 1x1 convolution"
    elif kind == "1x1":
        size = pointwise_workspace(what, _bytes(a), _bytes(b), w.numel(), positions, itemsize)
        cause += " of a 1x1 convolution"
        if size[1] == size[2]:  # a recorded choice: no range
            if not (size[0] == TINY and itemsize < 4):  # none in 16 bits
                workspace = torch.empty(size[0], dtype=torch.uint8, device=a.device)
                del workspace
            return
    uncertain_empty(*size, f"{cause} ({what})", a)


def _kind(
    w: torch.Tensor, stride: Any, padding: Any, dilation: Any, transposed: bool, groups: int
) -> str:
    """The kind of a convolution: "1x1" for a 1x1 convolution with stride 1, no padding, no
    dilation and one group (a matrix product over channels, with no im2col buffer); "strided
    1x1" for one with a stride; else "general"."""
    one = (
        all(k == 1 for k in w.shape[2:])
        and all(p == 0 for p in padding)
        and all(d == 1 for d in dilation)
        and not transposed
        and groups == 1
    )
    if not one:
        return "general"
    return "1x1" if all(s == 1 for s in stride) else "strided 1x1"


def _depthwise(x: torch.Tensor, groups: int) -> bool:
    """Depthwise convolutions run kernels that take no workspace."""
    return groups > 1 and groups == x.shape[1]


def _positions(t: torch.Tensor) -> int:
    """Positions per image (H x W) of an activation (batch, channels, ...)."""
    n = 1
    for d in t.shape[2:]:
        n *= d
    return n


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
