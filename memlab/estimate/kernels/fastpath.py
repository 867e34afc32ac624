"""The fast paths of ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` without grad,
as a GPU takes them: the layer lets ``meta`` take the path, and the fused ops allocate what CUDA
does (the packed input projection, the attention kernel, the output projection, the
feed-forward block). Only the path without a mask is emulated."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from memlab.core import _torch
from memlab.estimate.autocast import _region
from memlab.estimate.kernels.attention import attention


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


def on_meta(fast: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
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


def fast_path_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _fast_path_allowed(original, self, args, kwargs):
            with _torch.privateuse1_named("meta"):  # the fast paths list that backend
                return original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return forward
