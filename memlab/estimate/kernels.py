"""CUDA kernels whose memory differs from what the same call does on ``meta``.

Attention: ``F.scaled_dot_product_attention`` picks a kernel by device. On ``meta`` (and on a
CPU in training) it falls back to the "math" version, which computes and saves the whole
``(batch, heads, L, S)`` attention matrix (and a dropout mask); on a recent NVIDIA GPU it picks
FlashAttention or the memory-efficient kernel, which save the output and one log-sum-exp per row
instead. `cuda_functions()` makes the estimator's step call the kernel CUDA would choose, in
PyTorch's order of preference: FlashAttention for float16/bfloat16 without a mask, then the
memory-efficient kernel (masks included), then math.

cuBLAS: on a GPU, a matrix product takes a workspace through the caching allocator, once per
cuBLAS handle, and keeps it. Handles are per thread, and the autograd engine runs a GPU's backward
on a thread of its own, so a training step holds two workspaces: the forward's and the
backward's. A product with a bias (``addmm``: ``nn.Linear``) goes through cuBLASLt, which takes a
workspace of its own on its first call. `CublasHandles` sees, on ``meta``, when each of those
first calls happens, so the estimator allocates the workspaces where a CUDA run would.

Dropout: on a GPU, ``F.dropout`` in training runs one fused kernel whose mask is one byte per
element; elsewhere it is a mask of the input's dtype (four bytes in float32), which the backward
keeps. `cuda_functions()` makes the step call the fused kernel.

The fast paths of ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention``: without grad, in
eval mode, PyTorch runs a layer as one native call on CPUs and GPUs, but not on ``meta``, which
would take the slower path of separate ops (copies of the heads included). `cuda_functions()`
lets ``meta`` take the fast path and gives those calls what a GPU allocates: the packed input
projection, the attention kernel, the output projection and the feed-forward block. Only the
fast path without a mask is emulated; with a mask, the layer takes the separate ops, as before.

Recurrent layers out of training: a GPU runs ``nn.LSTM`` through cuDNN, one call that keeps no
per-step state when the layer is in eval mode; on ``meta`` it would run cell by cell and, with
grad enabled, keep every step's gates. `cuda_functions()` runs an LSTM in eval mode through
cuDNN's call on ``meta``. In training the cell-by-cell run stays: its saved gates are close to
cuDNN's reserve space, whose size only cuDNN knows (as it knows its workspace, not modelled).

Random-number state: the attention kernels return their generator's seed and offset as CPU
tensors (outside CUDA graph capture), not on the GPU. `HostRandomState` puts them there too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memlab.estimate.autocast import HALF, _region

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


# -- dropout, transformer fast paths and the generator's state, as on a GPU ---------------------
_ORIGINAL_DROPOUT = F.dropout


def dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``F.dropout`` as CUDA runs it: in training, out of place, the fused kernel (a one-byte
    mask). In place, CUDA too takes the unfused path (a mask of the input's dtype)."""
    fused = training and not inplace and 0.0 < p < 1.0 and input.numel() > 0
    if fused and input.device.type == "meta":
        return torch.ops.aten.native_dropout(input, p, True)[0]  # type: ignore[no-any-return]
    return _ORIGINAL_DROPOUT(input, p, training, inplace)


def _mha_fast(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    embed_dim: int,
    num_heads: int,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor,
    mask: torch.Tensor | None = None,
    need_weights: bool = True,
    average_attn_weights: bool = True,
    mask_type: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``torch._native_multi_head_attention`` as a GPU runs self-attention without a mask or
    weights: one packed projection, the attention kernel on views of it, one projection out.
    Other calls: None (`_on_meta` then calls the op, whose meta kernel gives the outputs
    alone)."""
    if mask is not None or need_weights or not (query is key is value):
        return None
    b, n = query.shape[:2]
    qkv = F.linear(query, qkv_weight, qkv_bias)
    heads = qkv.view(b, n, 3, num_heads, embed_dim // num_heads).permute(2, 0, 3, 1, 4)
    y = attention(heads[0], heads[1], heads[2])  # (b, h, n, d), laid out as (b, n, h, d)
    out = F.linear(y.transpose(1, 2).reshape(b, n, embed_dim), proj_weight, proj_bias)
    return out, query.new_empty(0)


def _encoder_layer_fast(
    src: torch.Tensor,
    embed_dim: int,
    num_heads: int,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor,
    use_gelu: bool,
    norm_first: bool,
    eps: float,
    norm_weight_1: torch.Tensor,
    norm_bias_1: torch.Tensor,
    norm_weight_2: torch.Tensor,
    norm_bias_2: torch.Tensor,
    ffn_weight_1: torch.Tensor,
    ffn_bias_1: torch.Tensor,
    ffn_weight_2: torch.Tensor,
    ffn_bias_2: torch.Tensor,
    mask: torch.Tensor | None = None,
    mask_type: int | None = None,
) -> torch.Tensor | None:
    """``torch._transformer_encoder_layer_fwd`` as a GPU runs it without a mask: the residual
    sums in place, the feed-forward activation in place on the first projection's output. With
    a mask: None (`_on_meta` then calls the op, whose meta kernel gives the output alone)."""
    if mask is not None:
        return None
    shape = (embed_dim,)
    x = F.layer_norm(src, shape, norm_weight_1, norm_bias_1, eps) if norm_first else src
    weights = (qkv_weight, qkv_bias, proj_weight, proj_bias)
    attended = _mha_fast(x, x, x, embed_dim, num_heads, *weights, need_weights=False)
    assert attended is not None  # self-attention, no mask, no weights: emulated
    x = attended[0]
    del attended  # the output alone: a post-norm layer frees it at the norm
    x.add_(src)
    if not norm_first:
        x = F.layer_norm(x, shape, norm_weight_1, norm_bias_1, eps)
    normed = F.layer_norm(x, shape, norm_weight_2, norm_bias_2, eps) if norm_first else x
    h = F.linear(normed, ffn_weight_1, ffn_bias_1)
    h = torch.ops.aten.gelu_(h) if use_gelu else h.relu_()
    out = F.linear(h, ffn_weight_2, ffn_bias_2)
    del h, normed  # the block's input lives until its output exists
    out.add_(x)
    if not norm_first:
        out = F.layer_norm(out, shape, norm_weight_2, norm_bias_2, eps)
    return out


_ORIGINAL_LSTM = torch._VF.lstm


def _lstm(*args: Any, **kwargs: Any) -> Any:
    """``_VF.lstm`` (unpacked input) out of training, on ``meta``, as cuDNN runs it on a GPU."""
    if len(args) != 9 or kwargs or not isinstance(args[1], (tuple, list)):
        return _ORIGINAL_LSTM(*args, **kwargs)
    input, (h0, c0), weights, _, layers, p, train, bidirectional, batch_first = args
    if train or input.device.type != "meta" or _region() is not None:
        return _ORIGINAL_LSTM(*args, **kwargs)
    hidden = c0.shape[-1]
    proj = h0.shape[-1] if h0.shape[-1] != hidden else 0
    stride = len(weights) // (layers * (2 if bidirectional else 1))
    # cuDNN works sequence first: a batch-first input is copied to that layout, and the output
    # comes back as a transposed view of a sequence-first tensor (not contiguous)
    seq_first = input.transpose(0, 1).contiguous() if batch_first else input
    lstm_mode = 2  # cuDNN's mode number for an LSTM
    out = torch._cudnn_rnn(
        seq_first,
        weights,
        stride,
        None,
        h0,
        c0,
        lstm_mode,
        hidden,
        proj,
        layers,
        False,
        p,
        False,
        bidirectional,
        [],
        None,
    )
    del seq_first
    output = out[0].transpose(0, 1) if batch_first else out[0]
    return output, out[1], out[2]


def _on_meta(fast: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, but ``fast`` for tensors on meta, unless ``fast`` returns None (a call it
    does not emulate)."""

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))
        if first.device.type == "meta":
            out = fast(*args, **kwargs)
            if out is not None:
                return out
        return original(*args, **kwargs)

    return call


@contextlib.contextmanager
def _meta_as_a_gpu() -> Iterator[None]:
    """The fast paths run only on the devices they list: a private backend's name among them.
    For the block, that name is "meta"."""
    import torch.utils.backend_registration as registration

    before = registration._privateuse1_backend_name
    registration._privateuse1_backend_name = "meta"
    try:
        yield
    finally:
        registration._privateuse1_backend_name = before


def _fast_path_allowed(
    forward: Callable[..., Any], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether the emulated fast path may run: on meta, no mask, no weights asked for (the
    default of ``nn.MultiheadAttention``), and no emulated autocast (under real autocast the fast
    path is off). ``forward``: the class's own, whose signature the call follows."""
    try:
        call = inspect.signature(forward).bind(module, *args, **kwargs)
    except TypeError:  # a call the forward would refuse: let it say so
        return False
    call.apply_defaults()
    bound = call.arguments
    masks = ("attn_mask", "key_padding_mask", "src_mask", "src_key_padding_mask")
    first = args[0] if args else bound.get("src", bound.get("query"))
    return (
        isinstance(first, torch.Tensor)
        and first.device.type == "meta"
        and all(bound.get(m) is None for m in masks)
        and not bound.get("need_weights", False)  # (absent from the encoder layer's forward)
        and _region() is None
    )


def _fast_path_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _fast_path_allowed(original, self, args, kwargs):
            with _meta_as_a_gpu():
                return original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return forward


@contextlib.contextmanager
def cuda_functions() -> Iterator[None]:
    """Within the block, on ``meta``: attention through the kernel CUDA would pick (also as
    ``nn.MultiheadAttention`` and ``nn.Transformer*`` call it), dropout through the fused kernel,
    and the transformer layers' fast paths as a GPU takes them."""
    patches: list[tuple[Any, str, Any]] = [
        (F, "scaled_dot_product_attention", attention),
        (F, "dropout", dropout),
        (
            torch,
            "_native_multi_head_attention",
            _on_meta(_mha_fast, torch._native_multi_head_attention),
        ),
        (
            torch,
            "_transformer_encoder_layer_fwd",
            _on_meta(_encoder_layer_fast, torch._transformer_encoder_layer_fwd),
        ),
        (nn.MultiheadAttention, "forward", _fast_path_forward(nn.MultiheadAttention.forward)),
        (
            nn.TransformerEncoderLayer,
            "forward",
            _fast_path_forward(nn.TransformerEncoderLayer.forward),
        ),
        (torch._VF, "lstm", _lstm),
    ]
    missing = object()  # torch._VF finds its functions through __getattr__, not its __dict__
    before = [(owner, name, owner.__dict__.get(name, missing)) for owner, name, _ in patches]
    try:
        for owner, name, new in patches:
            setattr(owner, name, new)
        with _attention_meta_kernels():
            yield
    finally:
        for owner, name, old in reversed(before):
            if old is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


class CudaAllocations(TorchDispatchMode):
    """Kernels whose CUDA versions allocate more, or in another order, than their meta ones:

    - CUDA's layer norm (``native_layer_norm``) works on a contiguous copy of a strided input (a
      transposed view, or the sum of one), for the call's duration;
    - CUDA's fused dropout (``native_dropout``) allocates its mask before its output.

    Enter it after the accounting's mode, so that the accounting sees what it allocates."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        first = args[0] if args else None
        if not isinstance(first, torch.Tensor) or first.device.type != "meta":
            return func(*args, **(kwargs or {}))
        if func is aten.native_layer_norm.default and not first.is_contiguous():
            copy = torch.empty(first.shape, dtype=first.dtype, device=first.device)
            out = func(*args, **(kwargs or {}))
            del copy  # freed when the kernel returns, after its outputs exist
            return out
        if func is aten.native_dropout.default and args[2]:  # train=True (meta: no values)
            mask = torch.empty(first.shape, dtype=torch.bool, device=first.device)
            return torch.empty_like(first), mask
        return func(*args, **(kwargs or {}))


#: Ops whose outputs at these positions are the generator's seed and offset, on the CPU on a GPU
#: (FlashAttention keeps them on the GPU: two 8-byte tensors, as the traces show).
_HOST_OUTPUTS = {
    "_scaled_dot_product_efficient_attention": (2, 3),
    "_efficient_attention_forward": (2, 3),
}


class HostRandomState(TorchDispatchMode):
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
