"""CUDA kernels whose memory differs from what the same call does on ``meta``.

Attention: ``F.scaled_dot_product_attention`` picks a kernel by device. On ``meta`` (and on a
CPU in training) it falls back to the "math" version, which computes and saves the whole
``(batch, heads, L, S)`` attention matrix (and a dropout mask); on a recent NVIDIA GPU it picks
FlashAttention or the memory-efficient kernel, which save the output and one log-sum-exp per row
instead. `cuda_attention()` makes the estimator's step call the kernel CUDA would choose, in
PyTorch's order of preference: FlashAttention for float16/bfloat16 without a mask, then the
memory-efficient kernel (masks included), then math.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

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
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )
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
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale
        )
        return out[0]  # type: ignore[no-any-return]
    return _ORIGINAL(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


_ORIGINAL = F.scaled_dot_product_attention


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    """Within the block, ``F.scaled_dot_product_attention`` (also as ``nn.MultiheadAttention``
    and ``nn.Transformer*`` call it) runs the kernel CUDA would pick."""
    before = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = before
