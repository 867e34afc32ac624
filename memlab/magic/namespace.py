"""What the magics watch in the notebook's namespace: its tensors, modules and optimizers (and
those directly inside its short lists, tuples and dicts), so that their roles are known.

The scan runs at every tracked cell, and a namespace may hold thousands of tensors (and IPython
adds a name per input, ``_i42``). ``NamespaceWatch`` therefore looks again only at what changed:
one pass in C over the dict (``changed`` in memlab's library, `memlab.core.native.pack`; where it is
not loaded, the values' identities compared as one numpy array) finds the names bound or rebound
since the last scan; only those are examined in Python. Tensors under unchanged names are not
handed out again: their storages are already in the ledger, alive as long as the name holds them.
Modules, optimizers, tensors that require grad (a leaf's gradient, the graph behind a model's
output) and the contents of containers (mutable without a new binding) are handed out at every
scan, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
import sys
import weakref
from collections.abc import Container, Iterator
from typing import Any

import numpy as np
import torch

from memlab.core.known import Renewing
from memlab.core.native import pack

_WATCHED = (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)


#: Containers longer than this are not looked into (the scan runs at every tracked cell).
MAX_SCAN = 1000
#: Objects one scan hands out at most (each costs ~15 µs to register: a namespace of 200,000
#: tensors would hold its first cell for seconds); the names past them wait for the next scan.
MAX_FRESH = 20_000
_CONTAINERS = (list, tuple, dict)
_SKIP = frozenset({str, int, float, bool, type(None), type, type(len), type(lambda: 0)})


def watchable(ns: dict[str, Any], hidden: Container[str] = ()) -> list[Any]:
    """The notebook's tensors, modules and optimizers, and those directly inside its lists,
    tuples and dicts (short ones, not IPython's own In and Out). IPython adds a name per input
    (``_i42``), so this runs over thousands of names: the common case costs one isinstance."""
    found: list[Any] = []
    for name, value in list(ns.items()):
        _examine(name, value, hidden, found)
    return found


def _examine(name: Any, value: Any, hidden: Container[str], found: list[Any]) -> bool:
    """Adds what ``value`` (bound to ``name``) holds to ``found``; True for a scanned container."""
    kind = type(value)  # type(), never isinstance: a proxy's __class__ may raise
    if kind in _SKIP:  # IPython's input history is thousands of strings
        return False
    if issubclass(kind, _WATCHED):
        found.append(value)
    elif kind in _CONTAINERS and type(name) is str and name[:1] != "_" and name not in hidden:
        items = value.values() if kind is dict else value
        if len(items) <= MAX_SCAN:
            found.extend(v for v in items if issubclass(type(v), _WATCHED))
            return True
    return False


def _lasting(value: Any) -> bool:
    """Worth handing out at every scan: its roles can change without a new binding."""
    kind = type(value)
    if issubclass(kind, torch.Tensor):
        try:  # a leaf's gradient, or the graph a model's output holds (its activations)
            return bool(value.requires_grad)
        except Exception:  # a hostile subclass: hand it out every time, as the full scan did
            return True
    return True  # modules and optimizers


def _identities_by_map(values: Any, n: int) -> np.ndarray[Any, Any]:
    return np.fromiter(map(id, values), dtype=np.uintp, count=n)


def _identities_by_pointer(values: Any, n: int) -> np.ndarray[Any, Any]:
    """``id()`` of each value, read as the pointers an object array holds: in CPython an
    object's id is its address, and numpy stores an object array as those addresses. Four times
    quicker than calling ``id`` once per value (0.2 against 0.85 ms for 10,000 names)."""
    held = np.fromiter(values, dtype=object, count=n)  # never unpacks a value, unlike np.array
    if n == 0:
        return np.zeros(0, dtype=np.uintp)
    at = held.__array_interface__["data"][0]
    ids = np.ctypeslib.as_array((ctypes.c_size_t * n).from_address(at)).astype(np.uintp)
    del held  # the copy above is made: the values are no longer held
    return ids


#: How the watch reads the values' identities (CPython: the quick way; elsewhere: ``id``).
identities = _identities_by_pointer if sys.implementation.name == "cpython" else _identities_by_map


def _names(keys: list[Any]) -> list[str]:
    """The keys that are names (strings): the watch looks at no other."""
    return [k for k in keys if type(k) is str]


def _named(keys: list[Any], ids: list[int]) -> Iterator[tuple[str, int]]:
    return ((k, i) for k, i in zip(keys, ids, strict=True) if type(k) is str)


class NamespaceWatch(Renewing):
    """``watchable`` for one namespace, scanning only what changed since the last call.

    Each call returns the objects under names bound or rebound since the previous call, plus
    every module, optimizer and tensor that requires grad, plus the contents of the short
    containers. A name rebound to a new object that happens to reuse the old one's address
    between two calls is not seen as changed; its tensor is counted when a region uses it.
    Keys that are not strings (``globals()[k] = v``) are not looked at; a value whose type
    cannot be hashed is passed over, and any other failure makes the scan hand out nothing that
    time and start afresh at the next (it never raises: the cell runs).
    """

    def __init__(self, ns: dict[str, Any], hidden: Container[str] = (), ledger: Any = None) -> None:
        self.ns = ns
        self.hidden = hidden
        #: The ledger the handed-out tensors were registered in (the caller's key, unused here).
        self.ledger = ledger
        self._keys: list[Any] = []
        self._ids = bytearray()  # (their values' addresses at the last scan, as uintp)
        #: Per name: what is handed out at every call (modules, leaves, container contents).
        self._lasting: dict[Any, list[weakref.ref[Any]]] = {}
        self._containers: set[Any] = set()
        #: Names changed but not yet looked at (past `MAX_FRESH`): the next scan's first.
        self.waiting: set[Any] = set()

    def __call__(self) -> list[Any]:
        try:
            return self._scan()
        except Exception:  # (a hostile object: the next scan starts afresh, the cell still runs)
            self._keys, self._ids, self.waiting = [], bytearray(), set()
            self.renewed_to, self.told_at = 0, None
            return []

    def _scan(self) -> list[Any]:
        ns = self.ns
        changed = self._changed(ns) | self.waiting
        self.waiting = set()
        fresh: list[Any] = []
        for name in changed:
            if len(fresh) >= MAX_FRESH:
                self.waiting.add(name)
                continue
            self._lasting.pop(name, None)
            self._containers.discard(name)
            if name not in ns:
                continue
            found: list[Any] = []
            try:
                if _examine(name, ns[name], self.hidden, found):
                    self._containers.add(name)
                    continue  # rescanned below, as at every call
            except Exception:  # (a type whose metaclass cannot be compared: not looked at)
                continue
            for v in found:
                fresh.append(v)
                if _lasting(v):
                    self._keep(name, v)
        self.renewed_to = len(fresh)  # (the rest: handed out at every call)
        for name in self._containers:
            _examine(name, ns.get(name), self.hidden, fresh)
        for name, refs in self._lasting.items():
            if name not in changed or name in self.waiting:
                fresh.extend(v for v in (r() for r in refs) if v is not None)
        return fresh

    def _changed(self, ns: dict[Any, Any]) -> set[Any]:
        """Names bound, rebound or deleted since the last call. In C where memlab's library is
        loaded (`pack.namespace_scan`): the dict's entry table compared with the last one as
        memory, or one pass over the dict; else, and where that cannot tell (names deleted and
        the table rebuilt), the values' identities as one numpy array."""
        scan = pack.namespace_scan()
        if scan is not None and type(ns) is dict:
            try:
                names = scan(ns, self._keys, self._ids)  # (the record brought up to date)
            except Exception:  # (out of memory: the record is checked below)
                names = None
            if names is not None:  # (names are strings: another key, set by `globals()[k]`,
                return set(_names(names))  # may not hash again)
        old_keys, before = self._recorded()
        keys = list(ns)
        ids = identities(ns.values(), len(keys))
        self._keys, self._ids = keys, bytearray(ids.tobytes())
        m = len(old_keys)
        if len(keys) >= m and all(map(operator.is_, keys[:m], old_keys)):
            moved = np.flatnonzero(ids[:m] != before).tolist()
            found = {keys[i] for i in moved if type(keys[i]) is str}.union(_names(keys[m:]))
        else:
            old = dict(_named(old_keys, before.tolist()))
            now = dict(_named(keys, ids.tolist()))
            found = {k for k, _ in now.items() - old.items()} | (old.keys() - now.keys())
        if scan is not None and type(ns) is dict:  # recorded afresh, as the scan in C reads it
            self._keys, self._ids = [], bytearray()
            with contextlib.suppress(Exception):
                if scan(ns, self._keys, self._ids) is not None:
                    return found
            self._keys, self._ids = keys, bytearray(ids.tobytes())
        return found

    def _recorded(self) -> tuple[list[Any], np.ndarray[Any, Any]]:
        """The names of the last record and their values' addresses, in the dict's order (a
        record of the entry table's slots has None at a slot left empty: a name that is no
        string, as a key set by ``globals()[k]`` is, which the watch does not look at)."""
        keys, raw = self._keys, np.frombuffer(bytes(self._ids), dtype=np.uintp)
        if len(raw) == 2 * len(keys):  # (key, value) per slot
            return keys, raw[1::2]
        if len(raw) == len(keys):
            return keys, raw
        return [], raw[:0]  # (a record left half made: every name is new)

    def _keep(self, name: Any, value: Any) -> None:
        # held weakly: the watch keeps nothing alive; a value that cannot be weakly referred to
        # is seen when bound, and when a region uses it
        with contextlib.suppress(TypeError):
            self._lasting.setdefault(name, []).append(weakref.ref(value))
