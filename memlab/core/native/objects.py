"""Python objects the native record hands out: the saved aliases autograd still holds, and the
tensors whose type only Python can tell (a parameter). Read through ``ctypes.PyDLL``, which
keeps the GIL held during the call, so none of the objects can die before it is taken."""

from __future__ import annotations

import ctypes
from typing import Any

from torch.utils.weak import WeakIdKeyDictionary

_ALIASES: list[Any] = []
#: The buffer the library writes the objects' addresses into (grown as needed, kept).
_OUT: list[Any] = [(ctypes.c_ssize_t * 64)()]
_DECREF = ctypes.pythonapi.Py_DecRef
_DECREF.argtypes = [ctypes.c_void_p]
_DECREF.restype = None


def load(path: str) -> None:
    """Loads the library a second time through ctypes.PyDLL (the GIL held during calls)."""
    pylib = ctypes.PyDLL(path)
    fns = []
    for name in ("mn_aliases", "mn_typed"):
        fn = getattr(pylib, name)
        fn.argtypes = [ctypes.POINTER(ctypes.c_ssize_t), ctypes.c_int64]
        fn.restype = ctypes.c_int64
        fns.append(fn)
    _ALIASES[:] = fns


def _objects(which: int, cap: int) -> list[Any]:
    # (through ctypes.PyDLL: the GIL is held throughout, so none of them dies meanwhile)
    if not _ALIASES or cap <= 0:
        return []
    out = _OUT[0]
    if len(out) < cap:
        out = _OUT[0] = (ctypes.c_ssize_t * max(64, 1 << (cap - 1).bit_length()))()
    n = _ALIASES[which](out, cap)  # each with a reference of its own, taken in the call
    found = []
    for i in range(n):
        found.append(ctypes.cast(out[i], ctypes.py_object).value)
        _DECREF(out[i])  # (the list holds it now)
    return found


def saved_aliases(cap: int) -> list[Any]:
    """The Python objects of the open (or last) region's saved aliases that autograd still
    holds (at most ``cap``; handed out once)."""
    return _objects(0, cap)


def typed_tensors(cap: int) -> list[Any]:
    """The Python objects of the region's leaves and of the tensors older storages were first
    read through, where their storage has no lasting role yet (at most ``cap``)."""
    return _objects(1, cap)


#: Saved aliases a dispatch-mode region nested in a native one made with the record's op and
#: handed to the ledger itself: the native region does not hand them over again.
#: (Keyed by identity: a tensor's == compares its elements.)
HANDED = WeakIdKeyDictionary()
