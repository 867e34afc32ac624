"""Telling the ledger the storages behind the notebook's objects, without learning their roles.

A CPU region without a breakdown needs only that the ledger knows the storages it may free: a
tensor made outside any region (an untracked cell, a step run before ``%load_ext``) is then
counted when a region lets it go. `Roles.watch` learns roles too and costs about 10 µs a
tensor; `make_known` only registers what the ledger does not know yet (about 1 µs a tensor).

A notebook's model and optimizer are handed out by the namespace's watch at every cell (their
parameters, gradients and state change without a new binding). Most cells change none of it:
where the native record's allocator saw no block handed out that no followed op returned
(`mn_unfollowed`) since the watch's objects were last told, no new storage can be among them,
and only the objects under names bound since (`Renewing.renewed_to`) are looked at. A block
made while no region was open, or in one by code the record does not follow (another thread),
counts, so the next cell looks at everything again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from memlab.core._torch_record import unseen
from memlab.core.ledger import Ledger
from memlab.core.native import library
from memlab.core.roles import module_tree, state_tensors
from memlab.core.storages import storage_of


class Renewing:
    """A watch that says which of the objects it handed out last are new since the call before
    (`memlab.magic.namespace.NamespaceWatch`): the first ``renewed_to``; the rest it hands out
    at every call."""

    renewed_to = 0
    #: The record's count of unfollowed blocks when the ledger was last told all of them.
    told_at: int | None = None


def make_known(objects: Sequence[Any], ledger: Ledger, source: Any = None) -> list[str]:
    """The storages behind ``objects`` told ``ledger`` as existing where new to it: a module's
    parameters, their gradients and its buffers; an optimizer's parameters, their gradients and
    its state; a tensor and its gradient. ``source``: the watch they came from (a `Renewing`
    one lets unchanged objects be passed over, see the module's note). Returns the note on the
    objects that raised when looked at (skipped)."""
    renewing = isinstance(source, Renewing)
    lib = library(wait=False) if renewing else None  # (None: where it is not loaded)
    now = lib.mn_unfollowed() if lib is not None else None
    if now is not None and now == source.told_at:
        objects = objects[: source.renewed_to]
    skipped = 0
    if objects:
        ledger.settle()  # (a dead storage's id may be a live one's now)
    entries = ledger._entries  # (most are known already: looked up here, without a call)
    with unseen():  # (as `Roles.watch`: the program's torch function modes see none of it)
        for obj in objects:
            try:
                for t in _tensors_of(obj):
                    storage = storage_of(t)
                    if storage is not None and id(storage) not in entries:
                        ledger.existing(t, storage)
            except Exception:
                skipped += 1
    if renewing:  # (all told: not before, where a Ctrl-C may stop the telling half way)
        source.told_at = now
    return [f"skipped {skipped} object(s) memlab could not inspect"] if skipped else []


def _tensors_of(obj: Any) -> Iterable[torch.Tensor]:
    kind = type(obj)  # (never obj.__class__: a proxy's may raise)
    if issubclass(kind, torch.nn.Module):
        params, buffers = _members(obj)
        return _with_grads(params, buffers)
    if issubclass(kind, torch.optim.Optimizer):
        leaves = (p for group in obj.param_groups for p in group["params"])
        return _with_grads(leaves, state_tensors(obj))
    if issubclass(kind, torch.Tensor):
        return _with_grads((obj,), ()) if obj.requires_grad and obj.is_leaf else (obj,)
    return ()


def _members(module: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    """The parameters and buffers of ``module`` and of every module under it."""
    tree = module_tree(module)
    params = [p for m in tree for p in m._parameters.values() if p is not None]
    return params, [b for m in tree for b in m._buffers.values() if b is not None]


def _with_grads(leaves: Iterable[torch.Tensor], others: Iterable[torch.Tensor]) -> list[Any]:
    """``leaves``, each followed by its gradient where it has one, then ``others``."""
    found: list[Any] = []
    for p in leaves:
        found.append(p)
        grad = p.grad
        if grad is not None:
            found.append(grad)
    found.extend(others)
    return found
