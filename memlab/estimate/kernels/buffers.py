"""Buffers that CUDA kernels allocate for a call and a meta kernel does not: the
memory-efficient attention's backward buffers and the embedding backward's temporaries
(cuDNN's convolution workspaces: `conv.py`). `CudaAllocations` (`modes.py`) calls these after
the op's own outputs, as the GPU allocates them."""

from __future__ import annotations

from typing import Any

import torch

from memlab.core import _torch

aten = torch.ops.aten


EFFICIENT_BACKWARD = _torch.efficient_attention_backward.default


def efficient_backward_buffers(query: torch.Tensor) -> None:
    """What the memory-efficient attention's backward allocates on a GPU after the gradients
    (the encoder traces, torch 2.11 on an H100), ``query`` being ``(batch, heads, rows, dim)``:
    in float32, ``delta`` (one float per row) from a product and a sum, then a workspace of one
    float per query element and 64 B per head; in 16 bits, one workspace of a float per query
    element and per row, and 256 B. All freed when the call returns."""
    b, h, m, k = query.shape
    if query.dtype == torch.float32:
        product = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        rows = torch.empty((b, h, m), dtype=torch.float32, device=query.device)
        delta = torch.empty((b, h, m), dtype=torch.float32, device=query.device)
        del rows, product
        size = b * h * (m * k * 4 + 64)
    else:
        delta = None
        size = b * h * m * (k + 1) * 4 + 256
    work = torch.empty(size, dtype=torch.uint8, device=query.device)
    del delta, work


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


#: Indices up to which CUDA's embedding backward runs one kernel without sorting, and the rows
#: each thread sums (EmbeddingBackwardKernel.cu: NROWS_PER_THREAD).
EMBEDDING_DIRECT, ROWS_PER_THREAD = 3072, 10


def embedding_backward(
    func: Any, grad: Any, indices: Any, num_weights: int, padding: int, by_freq: bool
) -> Any:
    """``embedding_dense_backward`` as CUDA runs it (Embedding.cu, EmbeddingBackwardKernel.cu):
    the gradient made contiguous; over 3,072 indices, the indices sorted (two copies, a range
    and the sort's scratch), then segment offsets, partial-segment offsets and one float row per
    partial segment, sized by their upper bounds (as the LSTM traces show: 4,505 rows of 2 KiB
    for 4,096 indices). cub's scratch sizes are approximations (a few KiB, the small pool)."""
    kept = [grad.contiguous()] if not grad.is_contiguous() else []
    g = kept[0] if kept else grad
    n, dim = indices.numel(), g.shape[-1]
    if n <= EMBEDDING_DIRECT and not by_freq:
        return func(g, indices, num_weights, padding, by_freq)

    def longs(count: int) -> torch.Tensor:
        return torch.empty(count, dtype=torch.long, device=g.device)

    kept += [longs(n), longs(n)]  # sorted indices, their original places
    scratch = [longs(n), _bytes_on(g, 16 * n + 17919)]  # a range to sort, cub's scratch
    del scratch
    out = func(g, indices, num_weights, padding, by_freq)
    kept += [longs(n), longs(1)]  # segment offsets, their count
    scratch = [longs(n), _bytes_on(g, 1279)]
    del scratch
    segments = min(n, num_weights)
    kept += [longs(segments), longs(segments)]  # partials per segment, their offsets
    scratch_of(g)  # freed at once
    partials = n // ROWS_PER_THREAD + segments
    kept += [longs(1), longs(partials)]
    rows = torch.empty((partials, dim), dtype=torch.float32, device=g.device)
    del rows
    while kept:
        kept.pop()  # freed in the reverse order of their making
    return out


def scratch_of(like: torch.Tensor) -> torch.Tensor:
    """cub's scratch for a scan (about 1 KiB)."""
    return _bytes_on(like, 1279)


def _bytes_on(like: torch.Tensor, n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device=like.device)
