"""Finding the tensors in a user's namespace without running the user's code.

A namespace can hold anything: lazy proxies whose every attribute raises, objects whose
``__class__``, ``__len__``, ``__iter__``, ``__eq__`` or ``__repr__`` raise, properties with side
effects, huge containers and reference cycles. The scan reads only what needs no user code:
``type(x)``; the built-in containers through their base class's own methods (so a subclass's
overrides do not run); an instance's own ``__dict__`` and ``__slots__`` through the descriptors
Python made for its class (never ``__getattr__``, ``__getattribute__`` or a property); ``repr``
only of plain keys. It walks
with an explicit stack, visits each object once, looks at most `MAX_ITEMS` items of a container
and `MAX_OBJECTS` objects in all, and counts what it skipped and why (`Skipped.notes`).
"""

from __future__ import annotations

import itertools
import types
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch

#: Items looked at in one container; objects looked at in one scan.
MAX_ITEMS = 10_000
MAX_OBJECTS = 200_000

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview)
_OPAQUE = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.FrameType,
    types.GeneratorType,
)
#: Attributes of a module that hold what exists anyway (parameters, buffers: `_owned`).
_SKIP_ATTRS = ("_parameters", "_buffers")
_PLAIN_KEYS = (str, int, float, bool, type(None))

#: Why something was skipped -> how the note says it (with its count in front).
REASONS = {
    "attributes": "object(s) whose attributes could not be read (their code was not run)",
    "container": "container(s) that could not be iterated",
    "tensor": "tensor(s) whose storage could not be read (a tensor without storage, as an "
    "MKL-DNN one): not counted",
    "node": "autograd node(s) whose saved tensors could not be read",
    "items": "container item(s) past the first {max_items:,} of a container (not looked at)",
    "objects": "object(s) not looked at: the scan stops after {max_objects:,} objects",
}


class Skipped:
    """What a scan skipped, by reason (keys of `REASONS`)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, reason: str, n: int = 1) -> None:
        self.counts[reason] += n

    def notes(self) -> tuple[str, ...]:
        fmt = {"max_items": MAX_ITEMS, "max_objects": MAX_OBJECTS}
        return tuple(
            f"skipped {self.counts[r]:,} {REASONS[r].format(**fmt)}"
            for r in REASONS
            if self.counts[r]
        )


def type_name(tp: type) -> str:
    try:
        name = type.__dict__["__name__"].__get__(tp)
        return name if type(name) is str else "object"
    except Exception:
        return "object"


def key_text(k: Any) -> str:
    """A dict key for a path: ``repr`` of plain keys only (a user's ``__repr__`` may raise)."""
    if type(k) in _PLAIN_KEYS:
        return repr(k)
    return f"<{type_name(type(k))}>"


class _Layouts:
    """Where an instance keeps its attributes: its own ``__dict__`` and its ``__slots__``, read
    through the descriptors Python made for its class (never a property), cached per type."""

    def __init__(self) -> None:
        self._by_type: dict[int, tuple[type, Any, list[tuple[str, Any]]]] = {}  # by id(type)

    def attributes(self, value: Any, tp: type) -> Iterator[tuple[Any, Any]]:
        entry = self._by_type.get(id(tp))
        if entry is None or entry[0] is not tp:  # the type is kept alive: its id is its own
            entry = self._by_type[id(tp)] = (tp, *self._layout(tp))
        _, desc, slots = entry
        if desc is not None:
            d = desc.__get__(value, tp)
            if type(d) is dict:
                yield from dict.items(d)
        for name, member in slots:
            try:
                yield name, member.__get__(value, tp)
            except AttributeError:  # a slot not set
                continue

    @staticmethod
    def _layout(tp: type) -> tuple[Any, list[tuple[str, Any]]]:
        desc, slots = None, []
        for klass in type.__dict__["__mro__"].__get__(tp):
            ns = type.__dict__["__dict__"].__get__(klass)
            for name, attr in ns.items():
                if type(name) is not str:
                    continue
                if name == "__dict__" and desc is None:
                    if type(attr) not in (types.GetSetDescriptorType, types.MemberDescriptorType):
                        raise TypeError("__dict__ is the class's own code")  # not run: skipped
                    desc = attr
                elif type(attr) is types.MemberDescriptorType and not name.startswith("__"):
                    slots.append((name, attr))
        return desc, slots


def own_attributes(value: Any) -> list[tuple[Any, Any]]:
    """``value``'s own attributes (its ``__dict__`` and ``__slots__``), read as the scan reads
    them: no code of its class runs (none where its class makes ``__dict__`` itself)."""
    try:
        return list(_Layouts().attributes(value, type(value)))
    except Exception:
        return []


def _children(value: Any, tp: type, layouts: _Layouts) -> Iterable[tuple[str, Any]]:
    """(path suffix, child) pairs of a container's items or an object's attributes."""
    if issubclass(tp, dict):
        return ((f"[{key_text(k)}]", v) for k, v in dict.items(value))
    if issubclass(tp, list):
        return ((f"[{i}]", v) for i, v in enumerate(list.__iter__(value)))
    if issubclass(tp, tuple):
        return ((f"[{i}]", v) for i, v in enumerate(tuple.__iter__(value)))
    if issubclass(tp, (set, frozenset)):
        base = set if issubclass(tp, set) else frozenset
        return ((f"[{i}]", v) for i, v in enumerate(base.__iter__(value)))
    return (
        (f".{k}" if type(k) is str else f"[{key_text(k)}]", v)
        for k, v in layouts.attributes(value, tp)
        if type(k) is not str or k not in _SKIP_ATTRS
    )


def tensors_in(
    variables: Iterable[tuple[str, Any]], depth: int, skipped: Skipped
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(variable, path, tensor) for every tensor under the variables, ``depth`` levels into
    containers and object attributes, each object once, first found first (depth first)."""
    # id -> (object, levels left when it was looked at); the object is held so that no id is
    # reused during the scan. One reached again with more levels left is looked at again: a
    # list first met at the bottom of another variable's nesting is still scanned as its own.
    seen: dict[int, tuple[Any, int]] = {}
    layouts = _Layouts()
    visited = 0
    for name, root in variables:
        stack: list[tuple[Any, str, int]] = [(root, name, depth)]
        while stack:
            value, path, left = stack.pop()
            before = seen.get(id(value))
            if before is not None and (before[1] >= left or isinstance(before[0], torch.Tensor)):
                continue
            seen[id(value)] = (value, left)
            visited += 1
            if visited > MAX_OBJECTS:
                skipped.add("objects", len(stack) + 1)
                return
            tp = type(value)
            if issubclass(tp, torch.Tensor) and isinstance(value, torch.Tensor):
                yield name, path, value
                continue
            if issubclass(tp, torch.nn.Module):  # all its own tensors, submodules' included
                for t in _owned(value, skipped):
                    if id(t) not in seen:
                        seen[id(t)] = (t, 0)
                        yield name, f"{path} (its parameters and buffers)", t
            if left <= 0 or issubclass(tp, _ATOMS + _OPAQUE) or _shells(tp):
                continue
            try:
                items = list(itertools.islice(_children(value, tp, layouts), MAX_ITEMS + 1))
            except Exception:
                is_container = issubclass(tp, (dict, list, tuple, set, frozenset))
                skipped.add("container" if is_container else "attributes")
                continue
            if len(items) > MAX_ITEMS:
                items.pop()
                skipped.add("items", _remaining(value, tp))
            stack.extend((v, path + suffix, left - 1) for suffix, v in reversed(items))


def _owned(module: torch.nn.Module, skipped: Skipped) -> list[torch.Tensor]:
    """A module's parameters and buffers, its submodules' included (nn.Module's own methods;
    what raises is skipped and counted): they exist anyway, whatever graph saved them."""
    try:
        nn = torch.nn.Module
        return [*nn.parameters(module), *nn.buffers(module)]
    except Exception:
        skipped.add("attributes")
        return []


def _shells(tp: type) -> bool:
    """Whether ``tp`` is IPython's or the kernel's own (``exit``, ``quit``, the shell): they
    reach the whole namespace, whose variables are scanned as themselves."""
    try:
        module = type.__dict__["__module__"].__get__(tp)
    except Exception:
        return False
    return type(module) is str and module.startswith(("IPython.", "ipykernel."))


def _remaining(value: Any, tp: type) -> int:
    """How many items of a cut container were not looked at (built-in ``len``, no user code)."""
    for base in (dict, list, tuple, set, frozenset):
        if issubclass(tp, base):
            try:
                return max(1, int(base.__len__(value)) - MAX_ITEMS)
            except Exception:
                return 1
    return 1
