"""What stays alive for backward where a saved-tensors hook packed a node's saved tensor into
something else: activation checkpointing's hook packs a placeholder, and what backward really
keeps is the checkpoint's inputs, from which it recomputes the rest.

Non-reentrant ``torch.utils.checkpoint`` (Hugging Face's gradient checkpointing included) runs
its forward under a pack hook that returns a small holder; the hook's unpack half is a closure
over the checkpoint's frame, whose ``saved_args`` keep the inputs (as ``SavedTensor``s, or the
objects themselves where no tensor) and whose ``recompute_fn`` keeps the keyword arguments.
Reentrant checkpointing needs nothing here: its ``CheckpointFunctionBackward`` saves its
inputs with ``save_for_backward``, read as any node's. The frame is read in the seam
(`memlab.core._torch_autograd`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from memlab.core._torch_autograd import checkpoint_frame, checkpoint_inputs, checkpoint_keywords
from memlab.graphs.args import tensors_of


@dataclass(frozen=True, eq=False)
class Packed:
    """A saved tensor a program's hook packed as no tensor. ``frame``: the activation checkpoint
    whose hook it is (the tensor is recomputed in backward from the frame's inputs); None for
    another hook, whose packed value memlab cannot read (not counted: the total is then a lower
    bound)."""

    frame: Any


def packed(hook: Any) -> Packed:
    """The `Packed` for a value ``hook`` (the unpack hook set on it) will unpack."""
    return Packed(checkpoint_frame(hook))


def frame_inputs(frame: Any) -> Iterator[torch.Tensor | Packed]:
    """What checkpoint ``frame`` saved for its recomputation: its positional tensor inputs,
    and a `Packed` for each an enclosing checkpoint's hook packed (checkpoints nested). Never
    runs an unpack hook (`memlab.core._torch_autograd.checkpoint_inputs`)."""
    for value, hook in checkpoint_inputs(frame):
        if hook is not None:
            yield packed(hook)
        else:  # (a tensor, or the tensors in an input that is none)
            yield from tensors_of(value)


def frame_keywords(frame: Any) -> list[torch.Tensor]:
    """The tensors checkpoint ``frame`` keeps by reference, not saved (its keyword arguments, a
    partial's bound ones). They stay alive until backward as the saved inputs do, but autograd
    never saved them (`memlab.track` counts them as other)."""
    return tensors_of(checkpoint_keywords(frame))
