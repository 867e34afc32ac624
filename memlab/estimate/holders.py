"""Which of the user's variables hold which storages: names for the tensors an out-of-memory
explanation lists, and the variables a ``del`` lever would drop (`memlab.estimate.preflight`,
`memlab.estimate.after_oom`)."""

from __future__ import annotations

import re
from collections.abc import Container
from typing import Any

import torch

from memlab.core.ledger import Ledger
from memlab.graphs.scan import key_text

#: Containers longer than this are not looked into for variable names.
MAX_SCAN = 1000


def variable_names(
    ledger: Ledger, namespace: dict[str, Any], hidden: Container[str] = ()
) -> dict[int, list[str]]:
    """Which user variables hold which storages (by serial): tensors, those directly in short
    lists, tuples and dicts, and the parameters and buffers of modules (``model.fc.weight``);
    found by ``type()`` and the modules' own dicts, so none of the user's code runs (a dict's
    keys are shown by ``repr`` only when plain; names that are not str are passed over)."""
    names: dict[int, list[str]] = {}

    def note(name: str, value: Any) -> None:
        kind = type(value)
        if issubclass(kind, torch.Tensor):
            serial = ledger.serial_of(value)
            if serial is not None:
                names.setdefault(serial, []).append(name)
        elif issubclass(kind, torch.nn.Module):
            for path, t in module_tensors(value):
                note(f"{name}.{path}", t)

    for name, value in list(namespace.items()):
        if type(name) is not str or name[:1] == "_" or name in hidden:
            continue
        kind = type(value)
        if kind in (list, tuple) and len(value) <= MAX_SCAN:
            for i, v in enumerate(value):
                note(f"{name}[{i}]", v)
        elif kind is dict and len(value) <= MAX_SCAN:
            for k, v in dict.items(value):
                note(f"{name}[{key_text(k)}]", v)
        else:
            note(name, value)
    return names


def module_tensors(module: torch.nn.Module, limit: int = 10 * MAX_SCAN) -> list[tuple[str, Any]]:
    """A module's parameters and buffers by dotted path, each tensor once (a shared one under
    its first path), read from the modules' own dicts (no ``named_parameters`` or
    ``__getattr__`` of the user's runs); at most ``limit`` modules are looked into."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    queue: list[tuple[str, Any]] = [("", module)]
    visited: set[int] = set()
    while queue and len(visited) < limit:
        prefix, m = queue.pop()
        if id(m) in visited:
            continue
        visited.add(id(m))
        try:
            own = object.__getattribute__(m, "__dict__")
        except Exception:  # (a module without one: nothing to read)
            continue
        for key in ("_parameters", "_buffers"):
            held = own.get(key)
            if isinstance(held, dict):
                for n, t in dict.items(held):
                    if type(n) is str and issubclass(type(t), torch.Tensor) and id(t) not in seen:
                        seen.add(id(t))
                        found.append((prefix + n, t))
        children = own.get("_modules")
        if isinstance(children, dict):
            for n, child in reversed(list(dict.items(children))):
                if type(n) is str and issubclass(type(child), torch.nn.Module):
                    queue.append((f"{prefix}{n}.", child))
    return found


def variable_root(name: str) -> str:
    """The variable a name from `variable_names` starts with: ``model`` of ``model.fc.weight``,
    ``batch`` of ``batch['x']``."""
    return re.split(r"[\[.]", name, maxsplit=1)[0]
