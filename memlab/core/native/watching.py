"""What a native breakdown's ``watch`` names, the quick way (`NativeRoles`' base).

`Roles.watch` names a module's and an optimizer's tensors one by one through their generators
(``parameters()``, ``buffers()``), twice a region (at its start and at its end). For a notebook's
model and Adam that is about 900 names a region, 2-3 ms each time. The native roles already
know how to name a module at its call (`NativeRoles._name_module`: its own parameters and
buffers, each parameter once a process while its memory is the same) and an optimizer whose
groups and state did not change (`name_optimizer`: nothing); ``watch`` uses them too. Only the
gradients, which a backward or ``zero_grad`` replaces without a trace, are looked at each time,
and named where they are new (`QuickWatch._name_grad`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memlab.core.categories import Category
from memlab.core.native.optimizers import name_optimizer
from memlab.core.roles import module_tree


class QuickWatch:
    """``watch_module`` and ``watch_optimizer`` for `memlab.core.native.roles.NativeRoles`."""

    # (NativeRoles')
    _optimizers: Any
    _named: Any
    _grad_refs: dict[int, tuple[weakref.ref[torch.Tensor], int]]
    mark: Callable[[torch.Tensor, Category], None]
    _name_module: Callable[[torch.nn.Module], None]

    #: The parameters whose gradients one `watch` looked at through a module: an optimizer's
    #: look at them again is skipped (None outside `watch`).
    _through_modules: set[int] | None = None

    def watch(self, objects: Iterable[Any]) -> None:
        found = list(objects)  # the modules first (a notebook's `opt` may come before `model`)
        found.sort(key=lambda obj: not issubclass(type(obj), torch.nn.Module))
        self._through_modules = set()  # (ids of parameters the objects hold: alive meanwhile)
        try:
            super().watch(found)  # type: ignore[misc]
        finally:
            self._through_modules = None

    def watch_module(self, module: torch.nn.Module, recurse: bool = True) -> None:
        seen = self._through_modules
        for m in module_tree(module) if recurse else [module]:
            self._name_module(m)
            for p in m._parameters.values():
                if p is not None:
                    if seen is not None:
                        seen.add(id(p))
                    if (grad := p.grad) is not None:
                        self._name_grad(grad)

    def watch_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self._optimizers.add(opt)
        seen = self._through_modules or ()
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in seen and (grad := p.grad) is not None:
                    self._name_grad(grad)
        name_optimizer(self, opt, self._named)

    def _name_grad(self, grad: torch.Tensor) -> None:
        """A gradient named: once a process while its tensor and memory are the ones named
        before (a gradient is a role kept from region to region, as `mark` keeps it), so that
        the module's and the optimizer's watch, at the region's start and at its end, name each
        once, without asking for its storage each time."""
        refs = self._grad_refs
        seen = refs.get(id(grad))
        if seen is not None and seen[0]() is grad and seen[1] == grad.data_ptr():
            return
        self.mark(grad, Category.GRADIENT)
        with contextlib.suppress(TypeError, RuntimeError):  # (no weak reference, no data)
            refs[id(grad)] = (weakref.ref(grad), grad.data_ptr())
