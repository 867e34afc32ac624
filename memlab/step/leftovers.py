"""Models that earlier what-if runs were given and that outlive them.

A run drops its model when it ends, but a model can outlive it: one the user keeps and gave as
``model_fn=lambda: model``, or one in a reference cycle (torch's parametrizations, as
``weight_norm`` and ``spectral_norm`` make them; a module that registers one of its own methods
as a hook, as transformers' Mamba does), freed only when Python's cyclic garbage collector next
runs (memlab never calls ``gc.collect()`` itself). The run had watched its tensors, so the
ledger knows them from then on: a later run leaves them out of its figures (they predate it and
it never touches them: `memlab.track`'s ``since``), as the same run in a fresh process would.
On a GPU the device's peak still counts them, and the run says so."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from memlab.core.storages import storage_of
from memlab.reports.units import fmt_bytes

#: Every module of the models runs were given, held weakly.
GIVEN: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@dataclass(frozen=True)
class Leftovers:
    """The modules of models earlier runs were given, still alive beside a run's model:
    ``held`` bytes of parameters and buffers that model does not share, of ``named`` kinds."""

    held: int = 0
    named: str = ""

    def notes(self, device: torch.device, left_out: bool) -> list[str]:
        """What they mean for the run's figures. Where the run leaves them out (``left_out``:
        a run's figures are those of the same run in a fresh process), only on a GPU, whose
        peak is the device's own and counts every tensor on it."""
        if not self.held or (left_out and device.type != "cuda"):
            return []
        where = (
            "in the device's peak, which counts every tensor on it, though left out of this "
            "step's breakdown"
            if left_out
            else "counted in this run's figures as parameters"
        )
        return [
            f"modules of models given to earlier runs ({self.named}) are still alive beside "
            f"this run's model, {fmt_bytes(self.held)} of parameters and buffers on {device}: "
            f"{where}. Either your own variables hold them (a model you gave a run as "
            "model_fn=lambda: model, which stays yours), or a reference cycle does (torch's "
            "parametrizations such as weight_norm, a module's own method registered as a hook, "
            "as in transformers' Mamba), which only Python's garbage collector frees: "
            "gc.collect() frees those (memlab never calls it), del frees your own."
        ]


def left_behind(model: nn.Module) -> Leftovers:
    """The modules of models earlier runs were given that are still alive beside ``model``
    and hold tensors it does not (none on ``meta``, where an estimate leaves them out of its
    figures); ``model``'s modules join those given."""
    modules = list(model.modules())
    if any(t.is_meta for t in _tensors(modules)):
        return Leftovers()
    mine = set(map(id, modules))
    shared = {id(s) for s in _storages(modules)}
    earlier = [m for m in list(GIVEN) if id(m) not in mine]
    GIVEN.update(modules)
    theirs = {id(s): s for s in _storages(earlier) if id(s) not in shared}
    held = sum(s.nbytes() for s in theirs.values())
    if not held:
        return Leftovers()
    inner = {id(c) for m in earlier for c in m.children()}  # named by the outermost alive
    kinds = sorted({type(m).__name__ for m in earlier if id(m) not in inner})
    return Leftovers(held, ", ".join(kinds[:3]) + (", ..." if len(kinds) > 3 else ""))


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
