"""What a forward returns (and what input_fn returns), walked: the tensors inside, the loss it
holds, a copy without the graph. Tuples, lists and mappings (a Hugging Face ``ModelOutput`` is
one) are unpacked, and so are dataclass instances (``@dataclass class Out: logits: Tensor``),
field by field, as a mapping of their fields."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from memlab.graphs.args import fields_of as graph_fields
from memlab.step.config import WhatIfError
from memlab.step.model import call


def fields_of(value: Any) -> dict[str, Any] | None:
    """A dataclass instance's fields by name, read as the graphs read them (no code of its class
    runs); None for anything else, a mapping included (a ``ModelOutput`` is unpacked as the
    mapping it is)."""
    return None if isinstance(value, Mapping) else graph_fields(value)


def tensors_in(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in an input or an output: itself, or inside its tuples, lists, mappings
    and dataclasses."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 4:
        return []
    fields = fields_of(value)
    if fields is not None:
        value = fields
    if not isinstance(value, (Mapping, tuple, list)):
        return []
    items = value.values() if isinstance(value, Mapping) else value
    return [t for v in items for t in tensors_in(v, depth + 1)]


def returned_loss(out: Any) -> torch.Tensor | None:
    """The loss in what a training step_fn returned: a one-element tensor, a mapping's or a
    dataclass's ``"loss"`` (a dict of metrics, a Hugging Face output) or the first item of a
    tuple or list (``(loss, logits)``), as such; None if there is none."""
    out = fields_of(out) or out
    if isinstance(out, Mapping):
        out = out.get("loss")
    elif isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out if isinstance(out, torch.Tensor) and out.numel() == 1 else None


def loss_of(loss_fn: Callable[[Any], torch.Tensor] | None, out: Any) -> torch.Tensor:
    """The step's loss: ``loss_fn(out)``, or the default: the model's own loss (a ``loss`` in
    its output mapping or dataclass, or a first tensor with one element, as ``(loss,
    logits)``), else the mean square of the output's first tensor."""
    if loss_fn is None:
        return _default_loss(out)
    loss = call("loss_fn", loss_fn, out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise WhatIfError(
            f"loss_fn must return a scalar tensor (e.g. end it with .mean()), not {shape}."
        )
    return loss


def _default_loss(out: Any) -> torch.Tensor:
    given = out
    unpacked = fields_of(out) or out
    if isinstance(unpacked, Mapping):  # e.g. a Hugging Face ModelOutput, or a dataclass
        own = unpacked.get("loss")
        if isinstance(own, torch.Tensor) and own.numel() == 1:
            return own  # the model computed its loss (it was given labels)
        unpacked = list(unpacked.values())
    first = unpacked if isinstance(unpacked, torch.Tensor) else None
    if isinstance(unpacked, (list, tuple)):
        first = next((t for t in unpacked if isinstance(t, torch.Tensor)), None)
    if first is None:
        raise WhatIfError(
            f"The model's forward returned {type(given).__name__}, which holds no tensor to "
            "train on at its top level (the default loss takes the first one there): return "
            "the output from forward, or pass a loss_fn."
        )
    if first.numel() == 1 and first.is_floating_point():
        return first  # a forward that computes its own loss: (loss, logits), or the loss
    return first.float().pow(2).mean()


def detach(out: Any) -> Any:
    """``out`` without the graph, to keep (a dataclass: as the mapping of its fields)."""
    out = fields_of(out) or out
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, Mapping):
        return {k: detach(v) for k, v in out.items()}
    return type(out)(detach(o) for o in out) if isinstance(out, (list, tuple)) else out
