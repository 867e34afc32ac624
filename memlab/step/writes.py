"""State outside the model that a ``step_fn`` writes in place, put back after the run: an EMA
copy of the model updated in the step (``ema_p.lerp_(p, 0.01)``, ``AveragedModel``), a running
total (``total += loss.detach()``). `restored` leaves the model itself as it was; this does the
same for the tensors step_fn reaches outside it.

While step_fn runs in the warm-up steps, `Writes` (a dispatch mode of memlab's) sees each op
that writes into one of its arguments (an in-place op, ``name_``, or an ``out=``). A tensor
written that the run did not make (not the model's parameters, buffers or gradients, not the
batch, not made earlier in the call) is copied to the CPU before its first write, once, and
copied back when the run ends, if it is still alive (memlab holds it by a weak reference). The
measured step runs without the mode, so its figures are not touched: it writes the tensors the
warm-up wrote. Not done: without a warm-up (``warmup=False``), with ``compile=True`` (a dispatch
mode would make dynamo run the model eagerly), on ``meta`` (an estimate makes its own tensors).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn

from memlab.core._torch import OwnedMode


@functools.cache
def _in_place(func: Any) -> bool:
    """Whether an op writes into its first argument: its name ends with one underscore."""
    name = func.name().split("::")[-1].split(".")[0]
    return name.endswith("_") and not name.endswith("__")


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` writes into: an in-place op's first argument (a list of them for a
    ``_foreach_*_``), or its ``out=``."""
    if args and _in_place(func):
        first = args[0]
    elif "out" in kwargs:
        first = kwargs["out"]
    else:
        return []
    items = first if isinstance(first, (list, tuple)) else [first]
    return [t for t in items if isinstance(t, torch.Tensor)]


def _flat(values: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (and in their lists, one level down)."""
    items = values if isinstance(values, (list, tuple)) else [values]
    found = []
    for v in items:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += [t for t in v if isinstance(t, torch.Tensor)]
    return found


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # a subclass without a storage of its own
        return 0


class Writes(OwnedMode):
    """The run's copies of the tensors step_fn wrote that the run did not make."""

    def __init__(self) -> None:
        super().__init__()
        #: Storages the run made (or that belong to the model): writes there are the run's.
        self.ours: set[int] = set()
        #: (storage, offset, shape, strides) -> its storage (weakly: the tensor written is
        #: often an alias made for the write, ``p.detach()``), and the value before.
        self.kept: dict[tuple[Any, ...], tuple[weakref.ref[Any], torch.Tensor, bool]] = {}

    def claim(self, model: nn.Module, tensors: list[torch.Tensor]) -> None:
        """Before a call of step_fn: the model's tensors and the batch are the run's."""
        for p in model.parameters():
            self.ours.add(_ptr(p))
            if p.grad is not None:
                self.ours.add(_ptr(p.grad))
        self.ours.update(_ptr(b) for b in model.buffers())
        self.ours.update(_ptr(t) for t in tensors)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        for t in _written(func, args, kwargs):
            ptr = _ptr(t)
            key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if ptr and ptr not in self.ours and key not in self.kept and not t.is_meta:
                with torch.no_grad():
                    value = t.detach().to("cpu", copy=True)
                ref = weakref.ref(t.untyped_storage())
                self.kept[key] = (ref, value, t.is_inference())
        out = func(*args, **kwargs)
        made = {_ptr(t) for t in _flat(out)} - {_ptr(t) for t in _flat([*args, *kwargs.values()])}
        self.ours |= made  # new storages, not views of the op's inputs (``p.detach()``)
        return out

    def put_back(self) -> int:
        """Each tensor written, alive still, to its value before the run; how many."""
        back = 0
        for key, (ref, value, inference) in reversed(self.kept.items()):  # a view's first wins
            storage = ref()
            if storage is None:
                continue
            _, offset, shape, stride = key
            with torch.inference_mode() if inference else torch.no_grad():
                t = torch.empty(0, dtype=value.dtype, device=storage.device)
                t.set_(storage, offset, shape, stride).copy_(value)
            back += 1
        self.kept.clear()
        return back
