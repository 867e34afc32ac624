"""Models that earlier what-if runs were given and that outlive them.

A run drops its model when it ends. A module in a reference cycle (torch's parametrizations,
as ``weight_norm`` and ``spectral_norm`` make them; a module that registers one of its own
methods as a hook, as transformers' Mamba does) is then freed only when Python's cyclic garbage
collector next runs, and until then its tensors are alive on the device: in the next run's
figures, as parameters. memlab never calls ``gc.collect()`` itself, so a run says when this
happens, and how much it adds."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from memlab.core.storages import storage_of
from memlab.reports.units import fmt_bytes

#: Every module of the models runs were given, held weakly.
GIVEN: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def left_behind(model: nn.Module) -> list[str]:
    """A note on the modules of models earlier runs were given that are still alive beside
    ``model`` and hold tensors it does not (none on ``meta``, where an estimate leaves them out
    of its figures); ``model``'s modules join those given."""
    modules = list(model.modules())
    if any(t.is_meta for t in _tensors(modules)):
        return []
    mine = set(map(id, modules))
    shared = {id(s) for s in _storages(modules)}
    earlier = [m for m in list(GIVEN) if id(m) not in mine]
    GIVEN.update(modules)
    theirs = {id(s): s for s in _storages(earlier) if id(s) not in shared}
    held = sum(s.nbytes() for s in theirs.values())
    if not held:
        return []
    inner = {id(c) for m in earlier for c in m.children()}  # named by the outermost alive
    kinds = sorted({type(m).__name__ for m in earlier if id(m) not in inner})
    named = ", ".join(kinds[:3]) + (", ..." if len(kinds) > 3 else "")
    return [
        f"modules of models given to earlier runs ({named}) are still alive beside this run's "
        f"model, {fmt_bytes(held)} of parameters and buffers, counted in this run's figures "
        "as parameters: something other than memlab keeps them, usually a reference cycle "
        "(torch's parametrizations such as weight_norm, a module's own method registered as a "
        "hook, as in transformers' Mamba) that only Python's garbage collector frees. Call "
        "gc.collect() before a run (memlab never does), or have model_fn return one model "
        "that every run reuses (each run leaves it as it was)."
    ]


def _tensors(modules: list[nn.Module]) -> list[torch.Tensor]:
    return [
        t
        for m in modules
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
        if t is not None
    ]


def _storages(modules: list[nn.Module]) -> list[torch.UntypedStorage]:
    found = (storage_of(t) for t in _tensors(modules) if not t.is_meta)
    return [s for s in found if s is not None]
