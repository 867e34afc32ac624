"""The user's side of a step: their model, their inputs, their forward and loss."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memlab.step.config import WhatIfError
from memlab.step.model import call, check_device

ModelFn = Callable[[], nn.Module]
InputFn = Callable[[int], Any]
LossFn = Callable[[Any], torch.Tensor]
StepFn = Callable[[nn.Module, Any], Any]


@dataclass(frozen=True)
class UserStep:
    """The user's side of a step: their model, inputs, and forward and loss."""

    model: nn.Module
    input_fn: InputFn
    loss_fn: LossFn | None
    step_fn: StepFn | None
    device: torch.device

    def forward(self, batch: int, mark: Callable[[torch.Tensor], None]) -> Any:
        """The model on input_fn(batch), or step_fn(model, input_fn(batch)). Without step_fn, a
        tuple is the forward's arguments, a mapping its keyword arguments (``{"input_ids": ...,
        "labels": ...}`` for a Hugging Face model), anything else its one argument."""
        value = call("input_fn", self.input_fn, batch)
        tensors = tensors_in(value)
        check_device("input_fn's result", tensors, self.device)
        for t in tensors:
            mark(t)
        if self.step_fn is not None:
            return self.step_fn(self.model, value)
        args: tuple[Any, ...] = value if isinstance(value, tuple) else (value,)
        kwargs: dict[str, Any] = {}
        if isinstance(value, Mapping):
            args, kwargs = (), dict(value)
        try:
            return self.model(*args, **kwargs)
        except TypeError as e:
            if not refused_arguments(e):
                raise
            raise WhatIfError(
                f"the model's forward refused the {len(args)} argument(s) input_fn returned "
                f"({e}). If input_fn returns (inputs, targets), give your own forward and loss: "
                "step_fn=lambda model, batch: criterion(model(batch[0]), batch[1])."
            ) from e

    def loss(self, out: Any) -> torch.Tensor:
        if self.step_fn is None:
            return loss_of(self.loss_fn, out)
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise WhatIfError(
                f"step_fn must return the scalar loss in training, not {got}: e.g. end it with "
                "criterion(model(x), y), or model(**batch).loss for a Hugging Face model."
            )
        return out


def tensors_in(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in an input: itself, or inside its tuples, lists and mappings."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 4:
        return []
    items = value.values() if isinstance(value, Mapping) else value
    if not isinstance(value, (Mapping, tuple, list)):
        return []
    return [t for v in items for t in tensors_in(v, depth + 1)]


def refused_arguments(e: TypeError) -> bool:
    """Whether the TypeError is the forward refusing its arguments (raised where PyTorch calls
    it, not inside it)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    words = ("positional argument", "unexpected keyword argument", "required positional")
    return where.endswith(("module.py", "run.py")) and any(w in str(e) for w in words)


def loss_of(loss_fn: LossFn | None, out: Any) -> torch.Tensor:
    """The step's loss: ``loss_fn(out)``, or the default: the model's own loss (a ``loss`` in
    its output mapping, or a first tensor with one element, as ``(loss, logits)``), else the
    mean square of the output's first tensor."""
    if loss_fn is None:
        if isinstance(out, Mapping):  # e.g. a Hugging Face ModelOutput
            own = out.get("loss")
            if isinstance(own, torch.Tensor) and own.numel() == 1:
                return own  # the model computed its loss (it was given labels)
            out = list(out.values())
        first = out if isinstance(out, torch.Tensor) else None
        if isinstance(out, (list, tuple)):
            first = next((t for t in out if isinstance(t, torch.Tensor)), None)
        if first is None:
            raise WhatIfError(
                f"The model's forward returned {type(out).__name__}, which holds no tensor to "
                "train on: return the output from forward, or pass a loss_fn."
            )
        if first.numel() == 1 and first.is_floating_point():
            return first  # a forward that computes its own loss: (loss, logits), or the loss
        return first.float().pow(2).mean()
    loss = call("loss_fn", loss_fn, out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise WhatIfError(
            f"loss_fn must return a scalar tensor (e.g. end it with .mean()), not {shape}."
        )
    return loss


def detach(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, Mapping):
        return {k: detach(v) for k, v in out.items()}
    return type(out)(detach(o) for o in out) if isinstance(out, (list, tuple)) else out
