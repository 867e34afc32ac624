"""How the accounting learns roles from the objects themselves: a module's parameters and
buffers, an optimizer's parameters and state, a tensor's gradient. The user's objects run their
own code when asked (an overridden ``parameters()``, a ``grad`` property): the caller decides
what a failure costs (`Accountant` skips the object and says so in the report's notes)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from memlab.core.categories import Category
from memlab.core.ledger import Ledger, storage_of


class Roles:
    """The watching half of `memlab.core.accounting.Accountant`."""

    ledger: Ledger
    errors: list[str]
    _optimizers: weakref.WeakSet[torch.optim.Optimizer]

    def _remember_leaf(self, t: torch.Tensor, storage: object = None) -> None:
        raise NotImplementedError

    def mark(self, t: torch.Tensor, category: Category) -> None:
        raise NotImplementedError

    def watch_module(self, module: torch.nn.Module, recurse: bool = True) -> None:
        for p in module.parameters(recurse=recurse):
            self._remember_leaf(p)
            if p.grad is not None:
                self.mark(p.grad, Category.GRADIENT)
        for b in module.buffers(recurse=recurse):
            self.mark(b, Category.BUFFER)

    def watch_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self._optimizers.add(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                self._remember_leaf(p)
                self.mark(p, Category.PARAMETER)
                if p.grad is not None:
                    self.mark(p.grad, Category.GRADIENT)
        for state in opt.state.values():
            for value in state.values() if isinstance(state, dict) else ():
                if isinstance(value, torch.Tensor):
                    self.mark(value, Category.OPTIMIZER_STATE)

    def watch(self, objects: Iterable[Any]) -> None:
        """Learn the roles of the storages behind modules, optimizers and tensors. An object
        that raises when looked at (a module whose parameters() fails, a tensor subclass that
        refuses its storage) is skipped and counted in the report's notes."""
        skipped = 0
        for obj in objects:
            try:
                self._watch_one(obj)
            except Exception:
                skipped += 1
        if skipped and not any(e.startswith("skipped") for e in self.errors):
            self.errors.append(f"skipped {skipped} object(s) memlab could not inspect")

    def _watch_one(self, obj: Any) -> None:
        kind = type(obj)  # never obj.__class__: a proxy's may raise
        if issubclass(kind, torch.nn.Module):
            self.watch_module(obj)
        elif issubclass(kind, torch.optim.Optimizer):
            self.watch_optimizer(obj)
        elif issubclass(kind, torch.Tensor):
            st = storage_of(obj)
            if st is None:
                return
            self.ledger.existing(obj, st)
            if obj.requires_grad and obj.is_leaf:
                self._remember_leaf(obj)
                if obj.grad is not None:
                    self.mark(obj.grad, Category.GRADIENT)
