"""CUDA kernels whose memory differs from what the same call does on ``meta``.

Attention: ``F.scaled_dot_product_attention`` picks a kernel by device. On ``meta`` (and on a
CPU in training) it falls back to the "math" version, which computes and saves the whole
``(batch, heads, L, S)`` attention matrix (and a dropout mask); on a recent NVIDIA GPU it picks
FlashAttention or the memory-efficient kernel, which save the output and one log-sum-exp per row
instead. `cuda_attention()` makes the estimator's step call the kernel CUDA would choose, in
PyTorch's order of preference: FlashAttention for float16/bfloat16 without a mask, then the
memory-efficient kernel (masks included), then math.

cuBLAS: on a GPU, a matrix product takes a workspace through the caching allocator, once per
cuBLAS handle, and keeps it. Handles are per thread, and the autograd engine runs a GPU's backward
on a thread of its own, so a training step holds two workspaces: the forward's and the
backward's. A product with a bias (``addmm``: ``nn.Linear``) goes through cuBLASLt, which takes a
workspace of its own on its first call. `CublasHandles` sees, on ``meta``, when each of those
first calls happens, so the estimator allocates the workspaces where a CUDA run would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils._python_dispatch import TorchDispatchMode

from memlab.estimate.autocast import HALF

aten = torch.ops.aten
#: Ops that call cuBLAS on a GPU (``_addmm_activation``: addmm with a fused GELU or ReLU).
CUBLAS = frozenset((aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._addmm_activation))
#: Of those, the ones that go through cuBLASLt (a bias added in the product's epilogue).
CUBLASLT = frozenset((aten.addmm, aten._addmm_activation))


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
    "_scaled_dot_product_flash_attention": _flash_meta,
    "_scaled_dot_product_efficient_attention": _efficient_meta,
}


@contextlib.contextmanager
def _attention_meta_kernels() -> Iterator[None]:
    """Registers the meta kernels above for the block, where this PyTorch has none."""
    missing = [
        name
        for name in _META_KERNELS
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta")
    ]
    if not missing:
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    try:
        for name in missing:
            library.impl(name, _META_KERNELS[name], "Meta")
        yield
    finally:
        library._destroy()  # the kernels go with it


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    """Within the block, ``F.scaled_dot_product_attention`` (also as ``nn.MultiheadAttention``
    and ``nn.Transformer*`` call it) runs the kernel CUDA would pick."""
    before = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = attention
    try:
        with _attention_meta_kernels():
            yield
    finally:
        F.scaled_dot_product_attention = before


class CublasHandles(TorchDispatchMode):
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
            thread = "forward" if torch._C._current_autograd_node() is None else "backward"
            for key in (thread, f"{thread} lt") if packet in CUBLASLT else (thread,):
                if key not in self.taken:
                    self.taken.append(key)
                    self.take(key)
        return out
