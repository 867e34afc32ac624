"""``torch.nn.functional.grouped_mm`` (``aten::_grouped_mm``) on ``meta`` as CUDA runs it.

Mixture-of-experts layers (transformers' Mixtral, Qwen2-MoE, ... since 5.0) multiply each
expert's tokens by its weights in one grouped product. On CUDA a bfloat16 product takes the
fused kernel and any other dtype a fallback (one product per group, written into the same
output: GroupedBlas.cpp, ``_grouped_mm_fallback``); PyTorch's meta kernel copies only the fused
kernel's checks and refuses float32, so an fp32 MoE model could not be estimated. The kernel
here gives the output CUDA makes for every dtype: its shape, and its rows padded to 16 bytes
(``create_grouped_gemm_output_tensor``). The fallback's per-group products go straight into
that output; nothing else is allocated."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from memlab.core import _torch

#: The op (as dispatch sees it) that ``F.grouped_mm`` and ``torch._grouped_mm`` call.
GROUPED_MM = "_grouped_mm"


def grouped_mm_meta(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The output of ``_grouped_mm(mat_a, mat_b, offs)`` as CUDA allocates it."""
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    groups = offs.shape[0] if offs is not None else 0
    if a_2d and b_2d:  # one (rows, cols) product per group of the shared dimension
        size = [groups, mat_a.shape[0], mat_b.shape[1]]
    elif a_2d:  # the tokens (rows of a) split among the experts' weights (b)
        size = [mat_a.shape[0], mat_b.shape[-1]]
    elif b_2d:
        size = [mat_a.shape[1], mat_b.shape[1]]
    else:  # a batched product
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    dtype = out_dtype or mat_a.dtype
    align = max(1, 16 // dtype.itemsize)
    padded = -(-size[-1] // align) * align
    stride = [size[1] * padded, padded, 1] if a_2d == b_2d else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


@contextlib.contextmanager
def grouped_mm_kernels() -> Iterator[None]:
    """Within the block, ``aten::_grouped_mm`` on meta takes every dtype, as CUDA does."""
    if not hasattr(torch.ops.aten, GROUPED_MM):  # before 2.8: no grouped products at all
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    try:
        # (below Library.impl: PyTorch 2.11 registers a meta kernel of its own from Python
        # and refuses a second one there, 2.13 takes it; ours stands in for the block alone)
        _torch.impl_over_composite(library, GROUPED_MM, grouped_mm_meta, "Meta")
        yield
    finally:
        _torch.destroy_library(library)  # torch's own meta kernel is back
