"""What stays alive for backward where a saved-tensors hook packed a node's saved tensor into
something else: activation checkpointing's hook packs a placeholder, and what backward really
keeps is the checkpoint's inputs, from which it recomputes the rest.

Non-reentrant ``torch.utils.checkpoint`` (Hugging Face's gradient checkpointing included) runs
its forward under a pack hook that returns a small holder; the hook's unpack half is a closure
over the checkpoint's frame, whose ``saved_args`` keep the inputs (as ``SavedTensor``s, or the
objects themselves where no tensor) and whose ``recompute_fn`` keeps the keyword arguments.
Reentrant checkpointing needs nothing here: its ``CheckpointFunctionBackward`` saves its
inputs with ``save_for_backward``, read as any node's. Checked 2.11, 2.13.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

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


def checkpoint_frame(hook: Any) -> Any:
    """The checkpoint frame an unpack hook closes over, or None where ``hook`` is not an
    activation checkpoint's (told by the frame's own attributes, not its private class name)."""
    for cell in getattr(hook, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(value, "saved_args") and callable(getattr(value, "recompute_fn", None)):
            return value
    return None


def frame_inputs(frame: Any) -> Iterator[torch.Tensor | Packed]:
    """What checkpoint ``frame`` saved for its recomputation: its positional tensor inputs
    (``saved_args``, a ``SavedTensor`` each, packed by an enclosing checkpoint's hook where
    checkpoints nest: then a `Packed` of that one). Never runs an unpack hook."""
    for arg in getattr(frame, "saved_args", ()):
        if hasattr(arg, "unpack_hook") and hasattr(arg, "data"):
            data = arg.data
            if isinstance(data, torch.Tensor):
                yield data
            elif arg.unpack_hook is not None:
                yield packed(arg.unpack_hook)
        else:
            yield from tensors_of(arg)


def frame_keywords(frame: Any) -> list[torch.Tensor]:
    """The tensors checkpoint ``frame`` keeps by reference, not saved: what its ``recompute_fn``
    closes over as ``kwargs``, and the arguments a ``functools.partial`` given as the function
    binds (Hugging Face's layers pass theirs so). They stay alive until backward as the saved
    inputs do, but autograd never saved them (`memlab.track` counts them as other)."""
    return tensors_of(_bound(getattr(frame, "recompute_fn", None)))


def _bound(recompute_fn: Any) -> list[Any]:
    """The keyword arguments and a partial's bound arguments that ``recompute_fn`` closes over;
    not the function itself (a module's parameters exist anyway) nor its saved RNG state
    (which `memlab.track` does not count as an activation either)."""
    cells = getattr(recompute_fn, "__closure__", None) or ()
    names = getattr(getattr(recompute_fn, "__code__", None), "co_freevars", ())
    found: list[Any] = []
    for name, cell in zip(names, cells, strict=False):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if name == "kwargs" and isinstance(value, dict):
            found.append(value)
        elif name == "fn" and isinstance(value, functools.partial):
            found.extend((value.args, value.keywords))
    return found
