"""``F.dropout`` as CUDA runs it in training: one fused kernel with a one-byte mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

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
