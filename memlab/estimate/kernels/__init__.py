"""CUDA kernels whose memory differs from what the same call does on ``meta``, emulated so that
a meta run allocates what a GPU would: attention (`attention`), cuBLAS workspaces, layer norm
and dropout (`modes`), dropout's fused kernel (`dropout`), the transformer layers' fast paths
(`fastpath`), cuDNN's recurrent layers (`rnn`) and its convolutions' workspaces (`conv`). Why
each differs: docs/estimator.md."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.nn.functional as F  # noqa: N812
from torch import nn

from memlab.core import _torch
from memlab.core.parts import part
from memlab.estimate.kernels.attention import attention, attention_meta_kernels
from memlab.estimate.kernels.dropout import dropout
from memlab.estimate.kernels.fastpath import (
    _encoder_layer_fast,
    _fast_path_allowed,
    _mha_fast,
    fast_path_forward,
    on_meta,
)
from memlab.estimate.kernels.modes import (
    CUBLAS,
    CUBLASLT,
    CublasHandles,
    CudaAllocations,
    HostRandomState,
)
from memlab.estimate.kernels.plain import linear_patch
from memlab.estimate.kernels.rnn import patches as rnn_patches

__all__ = [
    "CUBLAS",
    "CUBLASLT",
    "CublasHandles",
    "CudaAllocations",
    "HostRandomState",
    "_fast_path_allowed",
    "attention",
    "cuda_functions",
    "dropout",
]


@contextlib.contextmanager
def cuda_functions() -> Iterator[None]:
    """Within the block, on ``meta``: attention through the kernel CUDA would pick (also as
    ``nn.MultiheadAttention`` and ``nn.Transformer*`` call it), dropout through the fused kernel,
    the transformer layers' fast paths as a GPU takes them, and LSTM, GRU and RNN layers as
    cuDNN's one call, with its workspace and reserve space."""
    patches: list[tuple[Any, str, Any]] = [
        (F, "scaled_dot_product_attention", attention),
        (F, "dropout", dropout),
        linear_patch(),  # in the warm-up, the bias added in place (kernels/plain.py)
        *_torch.fused_op_patches(
            on_meta(_mha_fast, _torch.native_multi_head_attention),
            on_meta(_encoder_layer_fast, _torch.transformer_encoder_layer_fwd),
            dict((name, fn) for _, name, fn in rnn_patches())["lstm"],
        ),
        *(p for p in rnn_patches() if p[1] != "lstm"),
        (nn.MultiheadAttention, "forward", fast_path_forward(nn.MultiheadAttention.forward)),
        (
            nn.TransformerEncoderLayer,
            "forward",
            fast_path_forward(nn.TransformerEncoderLayer.forward),
        ),
    ]
    with _torch.patched(patches), attention_meta_kernels():
        yield


def __getattr__(name: str) -> Any:  # (its modules, imported when first asked for)
    return part(__name__, __file__, name)
