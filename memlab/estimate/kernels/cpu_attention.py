"""``F.scaled_dot_product_attention`` on ``meta`` through the kernel the CPU would pick, for
``estimate(cuda_kernels=False)``.

PyTorch chooses the attention kernel per device type, and has no choice for ``meta``: a meta
call always takes the math path, which keeps the whole attention matrix for the backward. A CPU
call takes the CPU's flash kernel whenever it can, which keeps the query, key, value, output and
a float32 log-sum-exp per query row (with grouped-query attention, the key and value as they
came, not repeated per head). The rules below are the CPU's (``use_flash_attention_cpp`` in
ATen's sdp_utils_cpp.cpp, PyTorch 2.4.1-2.13); anything they refuse takes the math path on the
CPU as on meta."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F  # noqa: N812

from memlab.core import _torch

#: The op (as dispatch sees it) that a CPU call of ``F.scaled_dot_product_attention`` takes.
CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

_ORIGINAL = F.scaled_dot_product_attention


def _heads_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return False
    if gqa:  # grouped-query attention: the key's heads divide the query's
        return k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0
    return q.shape[1] == k.shape[1] == v.shape[1]


def _mask_ok(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    if mask is None:
        return True
    if mask.requires_grad or mask.dim() not in (2, 4):
        return False
    if mask.shape[-2] not in (q.shape[2], 1) or mask.shape[-1] not in (k.shape[2], 1):
        return False
    batch, heads = mask.shape[0] in (1, q.shape[0]), mask.shape[1] in (1, q.shape[1])
    return mask.dim() == 2 or (batch and heads)


def cpu_flash_ok(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    gqa: bool,
) -> bool:
    """Whether a CPU call with these inputs takes the flash kernel (ATen's checks, in order)."""
    if not torch.backends.cuda.flash_sdp_enabled() or dropout_p > 0.0:  # one switch for both
        return False
    if any(t.is_nested for t in (q, k, v)) or not q.dim() == k.dim() == v.dim() == 4:
        return False
    if not _heads_ok(q, k, v, gqa) or not _mask_ok(q, k, mask):
        return False
    if not q.shape[-1] == k.shape[-1] == v.shape[-1] or 0 in (q.shape[2], k.shape[2]):
        return False
    if not q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:
        return False
    return q.dtype == k.dtype == v.dtype and q.dtype in _DTYPES


def cpu_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on meta through the kernel the CPU would pick."""
    if not query.is_meta or not cpu_flash_ok(query, key, value, attn_mask, dropout_p, enable_gqa):
        return _ORIGINAL(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    mask = attn_mask
    if mask is not None and mask.dtype == torch.bool:  # as ATen does: 0 where kept, -inf not
        keep = torch.scalar_tensor(0.0, dtype=query.dtype, device=mask.device)
        drop = torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=mask.device)
        mask = torch.where(mask, keep, drop)
    flash = getattr(torch.ops.aten, CPU_FLASH)
    out = flash(query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)
    return out[0]  # type: ignore[no-any-return]


@contextlib.contextmanager
def cpu_functions() -> Iterator[None]:
    """Within the block, on ``meta``: attention through the kernel the CPU would pick (where this
    PyTorch has a meta kernel for it; otherwise the math path, as before)."""
    if not _torch.has_meta_kernel(CPU_FLASH):
        yield
        return
    with _torch.patched([(F, "scaled_dot_product_attention", cpu_attention)]):
        yield
