"""``F.scaled_dot_product_attention`` through the kernel CUDA would pick: FlashAttention for
16-bit inputs without a mask, then the memory-efficient kernel (masks included), then math; and
meta kernels for the first two where this PyTorch has none (before 2.5)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from memlab.core import _torch
from memlab.estimate.autocast import HALF


def _flash_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, gqa: bool) -> bool:
    head = q.shape[-1]
    same = q.dtype == k.dtype == v.dtype
    return mask is None and not gqa and same and q.dtype in HALF and head % 8 == 0 and head <= 256


def _efficient_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
    align = 4 if q.dtype == torch.float32 else 8
    same = q.dtype == k.dtype == v.dtype
    floats = q.dtype in (torch.float32, *HALF)
    return same and floats and not gqa and q.dim() == 4 and q.shape[-1] % align == 0


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` through the kernel CUDA would pick."""
    if query.dim() == 4 and _flash_ok(query, key, value, attn_mask, enable_gqa):
        out = _torch.flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)
        return out[0]  # type: ignore[no-any-return]
    if _efficient_ok(query, key, value, enable_gqa):
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:  # as SDPA does: -inf where masked
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device).masked_fill_(
                bias.logical_not(), float("-inf")
            )
        if bias is not None:
            b, h, n, s = (*query.shape[:2], query.shape[2], key.shape[2])
            bias = bias.expand(b, h, n, s)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        out = _torch.efficient_attention(
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale
        )
        return out[0]  # type: ignore[no-any-return]
    return _ORIGINAL(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


_ORIGINAL = F.scaled_dot_product_attention


# PyTorch before 2.5 has no meta kernels for the two attention kernels' forwards (their backwards
# have one). These give the outputs a GPU allocates: the attention output, shaped like the query
# (value's last dimension), and the float32 log-sum-exp the backward needs, one per query row
# (the memory-efficient kernel pads the rows to a multiple of 32); the random-number generator's
# seed and offset, a few bytes.
def _flash_meta(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple[Any, ...]:
    b, h, n = query.shape[:3]
    out = query.new_empty((b, n, h, value.shape[-1])).transpose(1, 2)
    lse = query.new_empty((b, h, n), dtype=torch.float32)
    seed = query.new_empty((2,), dtype=torch.uint64)  # as later PyTorch's meta kernel
    offset = query.new_empty((), dtype=torch.uint64)
    empty = query.new_empty(0)
    return out, lse, None, None, n, key.shape[2], seed, offset, empty


def _efficient_meta(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    compute_log_sumexp: bool,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
) -> tuple[Any, ...]:
    b, h, n = query.shape[:3]
    out = query.new_empty((b, n, h, value.shape[-1])).transpose(1, 2)
    rows = -(-n // 32) * 32 if compute_log_sumexp else 0
    lse = query.new_empty((b, h, rows), dtype=torch.float32)
    seed, offset = (query.new_empty((), dtype=torch.long) for _ in range(2))
    return out, lse, seed, offset


_META_KERNELS = {
    _torch.FLASH_ATTENTION: _flash_meta,
    _torch.EFFICIENT_ATTENTION: _efficient_meta,
}


@contextlib.contextmanager
def attention_meta_kernels() -> Iterator[None]:
    """Registers the meta kernels above for the block, where this PyTorch has none."""
    missing = [name for name in _META_KERNELS if not _torch.has_meta_kernel(name)]
    if not missing:
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    try:
        for name in missing:
            library.impl(name, _META_KERNELS[name], "Meta")
        yield
    finally:
        _torch.destroy_library(library)  # the kernels go with it
