"""What the magics watch in the notebook's namespace: its tensors, modules and optimizers (and
those directly inside its short lists, tuples and dicts), so that their roles are known."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import torch

_WATCHED = (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)


#: Containers longer than this are not looked into (the scan runs at every tracked cell).
MAX_SCAN = 1000
_CONTAINERS = (list, tuple, dict)
_SKIP = frozenset({str, int, float, bool, type(None), type, type(len), type(lambda: 0)})


def watchable(ns: dict[str, Any], hidden: Container[str] = ()) -> list[Any]:
    """The notebook's tensors, modules and optimizers, and those directly inside its lists,
    tuples and dicts (short ones, not IPython's own In and Out). IPython adds a name per input
    (``_i42``), so this runs over thousands of names: the common case costs one isinstance."""
    found: list[Any] = []
    for name, value in list(ns.items()):
        kind = type(value)  # type(), never isinstance: a proxy's __class__ may raise
        if kind in _SKIP:  # IPython's input history is thousands of strings
            continue
        if issubclass(kind, _WATCHED):
            found.append(value)
        elif kind in _CONTAINERS and name[:1] != "_" and name not in hidden:
            items = value.values() if kind is dict else value
            if len(items) <= MAX_SCAN:
                found.extend(v for v in items if issubclass(type(v), _WATCHED))
    return found
