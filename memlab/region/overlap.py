"""Regions open at once on different threads (the what-if panel's runs beside a cell). The ledger
and the CUDA allocator's counters are the process's: what another thread's region allocates
shows in this region's figures too. Each region's report says when that happened. The regions
open on each thread are kept in order too: `memlab.mark` names into each (`open_here`)."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

_LOCK = threading.Lock()
#: id(region) -> (its thread, whether a region of another thread was open at once).
_OPEN: dict[int, tuple[int, bool]] = {}
#: The regions open on this thread, innermost last (weakly: a region dropped open is gone).
_MINE = threading.local()

NOTE = (
    "memlab measured another thread's work at the same time (the what-if panel, say): the "
    "process's memory is one, so what it allocated is in these figures too; measure again "
    "once it is done"
)


def opened(region: object) -> None:
    """``region`` opens on this thread; it and those open on others have overlapped."""
    me = threading.get_ident()
    with _LOCK:
        others = [key for key, (thread, _) in _OPEN.items() if thread != me]
        for key in others:
            _OPEN[key] = (_OPEN[key][0], True)
        _OPEN[id(region)] = (me, bool(others))
    _stack().append(weakref.ref(region))


def _stack() -> list[weakref.ref[Any]]:
    stack: list[weakref.ref[Any]] | None = getattr(_MINE, "regions", None)
    if stack is None:
        stack = _MINE.regions = []
    return stack


def open_here() -> list[Any]:
    """The regions open on this thread, the innermost first."""
    found = (ref() for ref in reversed(_stack()))
    return [r for r in found if r is not None and getattr(r, "_state", None) == "open"]


def notes(region: object) -> list[str]:
    """The note for ``region``, if another thread's region overlapped it (closed: forgotten)."""
    with _LOCK:
        entry = _OPEN.pop(id(region), None)
    stack = _stack()  # (it, and any region dropped open before it)
    stack[:] = [r for r in stack if (found := r()) is not None and found is not region]
    return [NOTE] if entry is not None and entry[1] else []


def _after_fork() -> None:  # the child's one thread: the others' regions are not open in it
    global _LOCK
    _LOCK = threading.Lock()
    me = threading.get_ident()
    for key in [k for k, (thread, _) in _OPEN.items() if thread != me]:
        del _OPEN[key]


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_after_fork)
