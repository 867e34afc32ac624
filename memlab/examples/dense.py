"""Fully connected models from torch.nn."""

from __future__ import annotations

from torch import nn


def mlp(width: int) -> nn.Module:
    """A transformer's feed-forward block: width → 4 × width → width, GELU between."""
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def dense_stack(width: int, depth: int) -> nn.Module:
    """``depth`` blocks of Linear(width, width) and GELU, each block a Sequential of its own (so
    ``checkpoint="auto"`` finds them)."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])
