"""What an autograd node saved for backward, read from its ``_saved_*`` attributes (and a Python
``autograd.Function``'s ``saved_tensors`` and the tensors it keeps on ``ctx``), and the nodes
whose saved tensors cannot be read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from memlab.core._torch import SAVED_PREFIX
from memlab.core._torch_autograd import (
    HOOKED,
    raw_saved_readable,
    saved_hook,
    saved_names,
    saved_value,
)
from memlab.core.frames import the_users
from memlab.core.storages import sparse_parts
from memlab.graphs.packed import Packed, frame_inputs, packed

#: A Python ``autograd.Function``'s node keeps what ``ctx.save_for_backward`` saved as the
#: built-in nodes keep theirs (a raw form beside the saved name), so `saved_value` reads it.
_FUNCTION = SAVED_PREFIX + "tensors"


class GraphFreedError(RuntimeError):
    """The graph's saved tensors were already released by ``backward()``."""


def saved_tensors(node: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(attribute, tensor) for each tensor ``node`` saved. Raises GraphFreedError when backward
    already released them (run the analysis before backward, or backward with retain_graph)."""
    for name, value in saved_values(node):
        if isinstance(value, torch.Tensor):
            yield name, value


def saved_values(node: Any) -> Iterator[tuple[str, torch.Tensor | Packed]]:
    """`saved_tensors`, and a `Packed` for each tensor a program's saved-tensors hook packed as
    something else (activation checkpointing's placeholder, an offloading hook's record): what
    backward keeps for it is not the tensor, and must be counted, or said to be left out."""
    names = saved_names(node)
    if isinstance(node, BackwardCFunction) and raw_saved_readable():
        names += (_FUNCTION,)
    for name in names:
        try:  # never a program's unpack hook (see there)
            value = saved_value(node, name, strict=name == _FUNCTION)
        except AttributeError:  # (a Function's tensor not given: nothing to read)
            continue
        except RuntimeError:
            freed = GraphFreedError(
                f"{type(node).__name__} was already run by backward(), which freed what it "
                "saved; look at the graph before calling backward() (or call backward with "
                "retain_graph=True)."
            )
            the_users(freed)  # (the user's order of calls: said without memlab's frames)
            raise freed from None
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor):
                yield name, t
            elif t is HOOKED:
                yield name, packed(saved_hook(node, name))
    if isinstance(node, BackwardCFunction) and not _torchs_own(node):
        yield from ctx_tensors(node)


def _torchs_own(node: Any) -> bool:
    """A Function of PyTorch's own (the reentrant checkpoint's keeps its RNG states on ctx, host
    bookkeeping that is not what backward computes from; its inputs are saved as usual)."""
    cls = getattr(type(node), "_forward_cls", None)
    return str(getattr(cls, "__module__", "")).split(".")[0] == "torch"


def ctx_tensors(node: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a Python ``autograd.Function`` keeps on its ``ctx`` as attributes
    (``ctx.scale = y * 2``) rather than through ``save_for_backward``: held as long as the
    node, as saved tensors are, and after backward too. Directly, or in a list, tuple or dict
    there; read from the instance's own dict, running none of the program's code."""
    try:
        own = object.__getattribute__(node, "__dict__")
        items = list(own.items()) if type(own) is dict else []
    except Exception:  # (a node without an instance dict)
        return
    for attr, value in items:
        kind = type(value)
        inner = value.values() if kind is dict else value if kind in (list, tuple) else (value,)
        if len(inner) > _MAX_IN_CTX:
            continue
        for t in inner:
            if issubclass(type(t), torch.Tensor):  # (type(): a proxy's __class__ never runs)
                yield f"ctx.{attr}", t


#: A list, tuple or dict on a ctx longer than this is not looked into (the walk stays bounded).
_MAX_IN_CTX = 1000


def kept_for_backward(node: Any, frames: dict[int, Any]) -> Iterator[torch.Tensor | None]:
    """The tensors backward keeps for ``node``: what it saved, and in place of what an
    activation checkpoint packed, that checkpoint's inputs (and of the checkpoints around it),
    each checkpoint once across the calls that share ``frames`` (id -> frame, kept alive there).
    None for a value another hook packed, which memlab cannot read."""
    for _, value in saved_values(node):
        stack = [value]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                yield item
            elif item.frame is None:
                yield None
            elif id(item.frame) not in frames:
                frames[id(item.frame)] = item.frame
                stack.extend(frame_inputs(item.frame))


def storages(t: torch.Tensor) -> tuple[Any, ...] | None:
    """The untyped storages that hold ``t``'s bytes: its one storage, or a sparse tensor's
    indices and values (a COO tensor's as they are, coalesced or not). None where there is no
    storage to read (a tensor subclass or layout without one)."""
    try:
        layout = t.layout
        if layout == torch.strided:
            return (t.untyped_storage(),)
        parts = sparse_parts(t)
        if not parts:
            return (t.untyped_storage(),)
        return tuple(p.untyped_storage() for p in parts)
    except Exception:  # NotImplementedError (no storage), RuntimeError, a subclass's own error
        return None


def op_name(node: Any) -> str:
    """The node's op: its type's name, or for a C++ node without a Python class of its own
    (``CppFunction``) the last part of its C++ name (``DifferentiableGraphBackward``)."""
    name = type(node).__name__
    if name != "CppFunction":
        return name
    try:
        full = node.name()
    except Exception:
        return name
    return (full.rpartition("::")[2] or name) if type(full) is str else name


def unreadable(node: Any) -> bool:
    """Whether what ``node`` saved cannot be read: a C++ node without a Python class of its own
    (``CppFunction``: a TorchScript graph's ``DifferentiableGraphBackward``, a C++ extension's
    function) keeps its saved tensors out of Python's reach, and so does a Python
    ``autograd.Function`` on a PyTorch that cannot read them without running hooks."""
    if type(node).__name__ == "CppFunction":
        return True
    return isinstance(node, BackwardCFunction) and not raw_saved_readable()


_PROBES: dict[torch.dtype, torch.Tensor] = {}
#: A wrapped number's type, and a lower one of its kind that it does not promote.
_BELOW = {torch.float64: torch.float16, torch.int64: torch.uint8, torch.complex128: torch.complex64}


def wrapped_number(t: torch.Tensor) -> bool:
    """Whether ``t`` is a Python number an op wrapped as a tensor: ``x * 0.5`` saves 0.5 as a
    0-dim float64 tensor on the host, whatever ``x``'s device. It is made outside the ops
    `memlab.track` sees (and never on the device), so neither counts it. Told apart by type
    promotion, where a wrapped number ranks below every tensor: a 0-dim float16 tensor with it
    stays float16, with a 0-dim float64 tensor becomes float64."""
    try:
        if type(t) is not torch.Tensor or t.dim() != 0 or t.device.type != "cpu":
            return False
        low = _BELOW.get(t.dtype)
        if low is None:
            return False
        probe = _PROBES.get(low)
        if probe is None:
            probe = _PROBES[low] = torch.empty((), dtype=low, device="cpu")
        return torch.result_type(probe, t) == low
    except Exception:
        return False
