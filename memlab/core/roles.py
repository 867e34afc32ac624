"""How the accounting learns roles from the objects themselves: a module's parameters and
buffers, an optimizer's parameters and state, a tensor's gradient. The user's objects run their
own code when asked (an overridden ``parameters()``, a ``grad`` property): the caller decides
what a failure costs (`Accountant` skips the object and says so in the report's notes)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from memlab.core import kv_caches, transforms
from memlab.core._torch_record import unseen
from memlab.core.categories import Category
from memlab.core.ledger import Ledger, default_ledger, storage_of
from memlab.core.older_graphs import saved_by_older_graphs


class Roles:
    """The watching half of `memlab.core.accounting.Accountant`."""

    ledger: Ledger
    errors: list[str]
    _optimizers: weakref.WeakSet[torch.optim.Optimizer]
    _leaves: WeakIdKeyDictionary
    #: id -> weak references to each leaf remembered and to its storage then.
    _leaf_refs: dict[int, tuple[weakref.ref[torch.Tensor], Any]]
    #: (storage id, role) -> weak reference to the storage, for each role told the ledger.
    _marked: dict[tuple[int, Category], weakref.ref[torch.UntypedStorage]]

    def _stepped_aside(self) -> None:
        """memlab's saved-tensor hooks stepped aside for a torch.func transform (see
        `memlab.core.transforms`): said once in the region's notes."""
        if transforms.NOTE not in self.errors:
            self.errors.append(transforms.NOTE)

    def _remember_leaf(self, t: torch.Tensor, storage: object = None) -> None:
        # Once per leaf and storage in a region: the same parameters come back at every op
        # that reads them, at every module call and at each end of an optimizer step.
        if storage is None:
            storage = storage_of(t)
        seen = self._leaf_refs.get(id(t))
        if seen is not None and seen[0]() is t and seen[1]() is storage:
            return
        self._leaf_refs[id(t)] = (weakref.ref(t), _ref_or_none(storage))
        self._leaves[t] = True
        if isinstance(t, torch.nn.Parameter):
            self.mark(t, Category.PARAMETER)

    def kv_caches_in(self) -> Callable[[], None]:
        """Names what Hugging Face's key/value caches hold (`memlab.core.kv_caches`) until the
        callable returned is called."""
        return kv_caches.named_by(self.mark)

    def mark(self, t: torch.Tensor, category: Category) -> None:
        # Once per storage and role in a region (telling the ledger again changes nothing):
        # the optimizer's hooks name every parameter, gradient and state before and after
        # each step.
        storage = storage_of(t)
        if storage is None:
            return
        key = (id(storage), category)
        told = self._marked.get(key)
        if told is not None and told() is storage:
            return
        self.ledger.classify(t, category, storage)
        self._marked[key] = weakref.ref(storage)

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
        for value in state_tensors(opt):
            self.mark(value, Category.OPTIMIZER_STATE)

    def watch(self, objects: Iterable[Any]) -> None:
        """Learn the roles of the storages behind modules, optimizers and tensors. An object
        that raises when looked at (a module whose parameters() fails, a tensor subclass that
        refuses its storage) is skipped and counted in the report's notes."""
        skipped = 0
        with unseen():  # (the program's function modes see none of it)
            for obj in objects:
                try:
                    self._watch_one(obj)
                except Exception:
                    skipped += 1
        if skipped and not any(e.startswith("skipped") for e in self.errors):
            self.errors.append(f"skipped {skipped} object(s) memlab could not inspect")

    def first_look(self, objects: Iterable[Any], graphs: bool) -> list[Any]:
        """``objects`` as a list (for `watch`); with ``graphs``, what the graphs behind the
        tensors among them hold saved is told the ledger first (`memlab.core.older_graphs`):
        before a region's record starts, so that it knows those storages from its start."""
        found = list(objects)
        if not graphs or self.ledger is not default_ledger():  # (the process's ledger's alone)
            return found
        outputs = []
        with unseen():  # (as in `watch`)
            for obj in found:
                try:
                    if issubclass(type(obj), torch.Tensor) and obj.grad_fn is not None:
                        outputs.append(obj)
                except Exception:  # a hostile subclass: `watch` counts it as skipped
                    continue
        try:
            notes = saved_by_older_graphs(outputs, self.ledger)
        except Exception:  # a graph that cannot be read: its storages stay "other"
            notes = ["what a graph from before the region saved: not read"]
        self.errors.extend(n for n in notes if n not in self.errors)
        return found

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


def module_tree(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and every module under it, each once (a module shared or in a cycle too), by
    its ``_modules``: one walk, where ``parameters()`` and ``buffers()`` walk the tree each."""
    tree, seen = [module], {id(module)}
    for m in tree:  # (grows as it goes)
        for child in m._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                tree.append(child)
    return tree


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors in ``opt.state`` (momentum, Adam's moments, step counters)."""
    return [
        v
        for state in opt.state.values()
        for v in (state.values() if isinstance(state, dict) else ())
        if isinstance(v, torch.Tensor)
    ]


def _none() -> None:
    return None


def _ref_or_none(storage: Any) -> Any:
    """A weak reference to ``storage``, or a callable answering None for a tensor without
    one (a sparse leaf): compared with ``is`` against the storage found next time."""
    return _none if storage is None else weakref.ref(storage)
