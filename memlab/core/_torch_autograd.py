"""The seam, continued: what autograd holds, read and wrapped where PyTorch offers no public way.

Like ``_torch.py``, one of the few places private PyTorch names are used (tests/test_layers.py
lists them). Three needs: reading what a graph saved without running a program's unpack hooks
(`saved_value`), reaching the function activation checkpointing recomputes in backward,
however the program imported ``checkpoint`` (`checkpoint_patches`), and reading what a
non-reentrant checkpoint keeps for that recomputation (`checkpoint_frame` and after).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as _ck

from memlab.core import _torch

_NAMES: dict[type, tuple[str, ...]] = {}


def saved_names(node: Any) -> tuple[str, ...]:
    """The names of the attributes through which ``node`` exposes its saved tensors
    (``_saved_x``), read once per node type."""
    names = _NAMES.get(type(node))
    if names is None:
        names = _NAMES[type(node)] = _torch.saved_attribute_names(node)
    return names


#: What `saved_value` answers for a saved tensor a program's hook packed as no tensor.
HOOKED = object()


def saved_value(node: Any, name: str, strict: bool = False) -> Any:
    """What autograd node ``node`` holds saved under ``name`` (``_saved_x``), never running a
    program's unpack hook (one may recompute a checkpointed forward, or copy an offloaded
    activation back). Through ``_raw_saved_x`` (``SavedTensor``s with ``unpack_hook`` and
    ``data``, 2.11 on): where a hook was set, what it packed if that is a tensor (memlab's
    alias, a hook that packs the tensor itself), else `HOOKED`; without hooks, or on a PyTorch
    without those attributes, the attribute as it is (``strict``: `HOOKED`, where a hook
    cannot be seen). Checked 2.4.1, 2.11, 2.13."""
    raw = getattr(node, "_raw" + name, None)
    items = raw if isinstance(raw, (list, tuple)) else (raw,)
    if raw is None or not all(hasattr(i, "unpack_hook") and hasattr(i, "data") for i in items):
        return HOOKED if strict else getattr(node, name)
    hooks = [item.unpack_hook for item in items]
    if all(hook is None for hook in hooks):  # nothing to run (raises if backward released it)
        data = [item.data for item in items]
        if not strict or any(d is None for d in data):  # (released, or a tensor not given)
            return getattr(node, name)
        return data if isinstance(raw, (list, tuple)) else data[0]  # (no version check)
    out = [item.data if isinstance(item.data, torch.Tensor) else HOOKED for item in items]
    return out if isinstance(raw, (list, tuple)) else out[0]


def saved_hook(node: Any, name: str) -> Any:
    """The unpack hook set on what ``node`` saved under ``name`` (its first tensor's, for a
    list); None where none is, or where this PyTorch cannot say. Checked 2.4.1, 2.11, 2.13."""
    raw = getattr(node, "_raw" + name, None)
    item = raw[0] if isinstance(raw, (list, tuple)) and raw else raw
    return getattr(item, "unpack_hook", None)


def checkpoint_patches(wrap: Callable[[Any], Any]) -> list[tuple[Any, str, Any]]:
    """(owner, name, replacement) patches under which every activation checkpoint, reentrant or
    not, runs ``wrap(function)`` where it would run the checkpointed function, its recomputation
    in backward included. ``torch.utils.checkpoint.checkpoint`` looks both names up in its module
    at each call, so a program that imported ``checkpoint`` itself (Hugging Face models do) is
    reached too. Checked 2.4.1, 2.11, 2.13."""
    found: list[tuple[Any, str, Any]] = []
    generator = getattr(_ck, "_checkpoint_without_reentrant_generator", None)
    if callable(generator):

        def without_reentrant(fn: Any, *rest: Any, **kwargs: Any) -> Any:
            return generator(wrap(fn), *rest, **kwargs)

        found.append((_ck, "_checkpoint_without_reentrant_generator", without_reentrant))
    function: Any = getattr(_ck, "CheckpointFunction", None)
    if function is not None and callable(getattr(function, "apply", None)):

        class Reentrant:
            @staticmethod
            def apply(run_function: Any, *rest: Any) -> Any:
                return function.apply(wrap(run_function), *rest)

        found.append((_ck, "CheckpointFunction", Reentrant))
    return found


def raw_saved_readable() -> bool:
    """Whether this PyTorch reads what a graph saved without running its hooks (``SavedTensor``
    has ``unpack_hook``: 2.11 on; not 2.4.1). Checked 2.4.1, 2.11, 2.13."""
    return hasattr(torch._C._autograd.SavedTensor, "unpack_hook")


def checkpoint_frame(hook: Any) -> Any:
    """The frame of the non-reentrant activation checkpoint whose unpack hook ``hook`` is (the
    hook closes over it), or None for another hook: told by the frame's own attributes
    (``saved_args``, ``recompute_fn``), not its private class name. Checked 2.11, 2.13."""
    for cell in getattr(hook, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(value, "saved_args") and callable(getattr(value, "recompute_fn", None)):
            return value
    return None


def checkpoint_inputs(frame: Any) -> Iterator[tuple[Any, Any]]:
    """What checkpoint ``frame`` saved for its recomputation, in order, never running an unpack
    hook: (tensor, None) for a tensor input; (None, unpack hook) for one an enclosing
    checkpoint's hook packed (checkpoints nested); (object, None) for an input that is no
    tensor (``saved_args`` keeps it as it is). Checked 2.11, 2.13."""
    for arg in getattr(frame, "saved_args", ()):
        if hasattr(arg, "unpack_hook") and hasattr(arg, "data"):
            data = arg.data
            if isinstance(data, torch.Tensor):
                yield data, None
            elif arg.unpack_hook is not None:
                yield None, arg.unpack_hook
        else:
            yield arg, None


def checkpoint_keywords(frame: Any) -> list[Any]:
    """What checkpoint ``frame`` keeps by reference for its recomputation, not saved: the
    keyword arguments its ``recompute_fn`` closes over, and the arguments a
    ``functools.partial`` given as the function binds (Hugging Face's layers pass theirs so);
    not the function itself nor its saved RNG state. Checked 2.11, 2.13."""
    recompute_fn = getattr(frame, "recompute_fn", None)
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
