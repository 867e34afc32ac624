"""Dispatch modes that give a meta run what a CUDA run allocates: the cuBLAS workspaces
(`CublasHandles`), kernels that allocate more or in another order (`CudaAllocations`), and the
attention kernels' random-number state on the host (`HostRandomState`)."""

from __future__ import annotations

from typing import Any

import torch

from memlab.core import _torch
from memlab.core._torch import OwnedMode
from memlab.estimate.kernels.buffers import (
    EFFICIENT_BACKWARD,
    efficient_backward_buffers,
    embedding_backward,
)
from memlab.estimate.kernels.conv import backward as conv_backward
from memlab.estimate.kernels.conv import forward as conv_forward
from memlab.estimate.kernels.plain import STATE as UNMEASURED
from memlab.estimate.kernels.plain import accumulated
from memlab.estimate.kernels.reduce import DEFAULT_SMS, staging

aten = torch.ops.aten
#: Ops that call cuBLAS on a GPU (``_addmm_activation``: addmm with a fused GELU or ReLU).
CUBLAS = frozenset((aten.mm, aten.addmm, aten.bmm, aten.baddbmm, _torch.addmm_activation))
#: Of those, the ones that go through cuBLASLt (a bias added in the product's epilogue).
CUBLASLT = frozenset((aten.addmm, _torch.addmm_activation))


class CublasHandles(OwnedMode):
    """Calls ``take(key)`` the first time the step needs each cuBLAS workspace: ``"forward"``
    and ``"backward"`` (the thread's handle; recomputation of checkpointed regions runs in the
    backward), and ``"forward lt"`` / ``"backward lt"`` for cuBLASLt. ``take`` runs after the
    op, whose output a GPU also allocates before it asks for the workspace."""

    def __init__(self, take: Any) -> None:
        super().__init__()
        self.take = take
        self.taken: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in CUBLAS:
            thread = "forward" if _torch.current_autograd_node() is None else "backward"
            for key in (thread, f"{thread} lt") if packet in CUBLASLT else (thread,):
                if key not in self.taken:
                    self.taken.append(key)
                    self.take(key)
        return out


class CudaAllocations(OwnedMode):
    """Kernels whose CUDA versions allocate more, or in another order, than their meta ones:

    - CUDA's layer norm (``native_layer_norm``) works on a contiguous copy of a strided input (a
      transposed view, or the sum of one), for the call's duration;
    - CUDA's fused dropout (``native_dropout``) allocates its mask before its output;
    - CUDA's sum over many rows into few outputs (a bias gradient) stages partial sums in a
      buffer for the call (`memlab.estimate.kernels.reduce`), after its output;
    - cuDNN's convolutions take a workspace for the call, after their outputs, of a size its
      algorithm sets (`memlab.estimate.kernels.conv`, by the kind of convolution; a range
      where the traces do not settle it);
    - CUDA's embedding backward over more than 3,072 indices sorts them and sums per segment,
      with temporaries of its own (`embedding_backward`);
    - in the warm-up step, which a GPU runs without a dispatch mode, the autograd engine sums a
      gradient that arrives twice in place (`memlab.estimate.kernels.plain`).

    ``sms``: the card's multiprocessors, which set the staging buffer's size. Enter it after the
    accounting's mode, so that the accounting sees what it allocates. Entering it starts the
    warm-up's emulation (`memlab.estimate.kernels.plain.STATE`), which the estimator ends where
    the measured step starts; leaving it ends it in any case."""

    def __init__(self, sms: int = DEFAULT_SMS) -> None:
        super().__init__()
        self.sms = sms

    def __enter__(self) -> CudaAllocations:
        super().__enter__()
        UNMEASURED.active = True  # the warm-up: on a GPU, without a dispatch mode
        return self

    def __exit__(self, *exc: Any) -> None:
        UNMEASURED.active = False
        super().__exit__(*exc)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        first = args[0] if args else None
        if not isinstance(first, torch.Tensor) or first.device.type != "meta":
            return func(*args, **(kwargs or {}))
        summed = accumulated(func, args, kwargs)
        if summed is not None:
            return summed
        if func is aten.native_layer_norm.default and not first.is_contiguous():
            copy = torch.empty(first.shape, dtype=first.dtype, device=first.device)
            out = func(*args, **(kwargs or {}))
            del copy  # freed when the kernel returns, after its outputs exist
            return out
        if func is aten.native_dropout.default and args[2]:  # train=True (meta: no values)
            mask = torch.empty(first.shape, dtype=torch.bool, device=first.device)
            return torch.empty_like(first), mask
        if func is EFFICIENT_BACKWARD:
            # the kernel reads the output's gradient laid out (batch, rows, heads, dim)
            laid = first.transpose(1, 2)
            copy = laid if laid.is_contiguous() else laid.contiguous()
            out = func(*args, **(kwargs or {}))
            efficient_backward_buffers(args[1])
            del copy
            return out
        if func is aten.embedding_dense_backward.default and not kwargs:
            return embedding_backward(func, *args)
        if func is aten.convolution.default:
            return conv_forward(func, args, kwargs or {})
        if func is aten.convolution_backward.default:
            return conv_backward(func, args, kwargs or {})
        if func in _SUMS:
            out = func(*args, **(kwargs or {}))
            buffer, semaphores = _staging(first, args[1] if len(args) > 1 else None, self.sms)
            if buffer:
                staged = torch.empty(buffer, dtype=torch.uint8, device=first.device)
                flags = torch.empty(semaphores, dtype=torch.uint8, device=first.device)
                del flags, staged  # the semaphores first, as the kernel frees them
            return out
        return func(*args, **(kwargs or {}))


_SUMS = frozenset((aten.sum.dim_IntList, aten.mean.dim))


def _staging(t: torch.Tensor, dims: Any, sms: int) -> tuple[int, int]:
    """The staging of a sum of ``t`` over ``dims``, where they are its leading dimensions of a
    contiguous ``t`` (rows) and the rest its outputs; else (0, 0)."""
    if not isinstance(dims, (list, tuple)) or not dims or not t.is_contiguous():
        return 0, 0
    k = len(dims)
    if sorted(d % t.dim() for d in dims) != list(range(k)) or k >= t.dim():
        return 0, 0
    rows = 1
    for n in t.shape[:k]:
        rows *= n
    outputs = t.numel() // max(rows, 1)
    return staging(rows, outputs, sms)


#: Ops whose outputs at these positions are the generator's seed and offset, on the CPU on a GPU
#: (FlashAttention keeps them on the GPU: two 8-byte tensors, as the traces show).
_HOST_OUTPUTS = {
    _torch.EFFICIENT_ATTENTION: (2, 3),
    _torch.EFFICIENT_ATTENTION_FORWARD: (2, 3),
}


class HostRandomState(OwnedMode):
    """Moves the attention kernels' seed and offset outputs to the CPU, as a GPU returns them.
    Enter it before the accounting's mode, so that the accounting sees them there."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        where = _HOST_OUTPUTS.get(func.overloadpacket.__name__)
        if where is None or not isinstance(out, tuple):
            return out
        moved = list(out)
        for i in where:
            t = moved[i]
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                moved[i] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return tuple(moved)
