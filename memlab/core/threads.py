"""What each thread has open, process-wide: a stack per thread under one lock.

memlab patches a library's class while any of its blocks is open, on any thread (the key/value
caches' ``update``, ``torch.autocast``'s methods), and puts it back after the last: the first
push and the last pop anywhere are the moments to patch and to restore. A forked child has one
thread: it keeps the forking thread's stack alone, with a fresh lock (one another thread held
at the fork would stay held)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any


class PerThread:
    """Stacks of open blocks by thread; ``opening(first)`` and ``closing(last)`` run under the
    lock as a block is pushed or popped (``first``: none was open anywhere; ``last``: none is
    left anywhere)."""

    def __init__(self) -> None:
        self._by: dict[int, list[Any]] = {}
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # (POSIX)
            os.register_at_fork(after_in_child=self._after_fork)

    def push(self, item: Any, opening: Callable[[bool], None]) -> None:
        with self._lock:
            opening(not self._by)
            self._by.setdefault(threading.get_ident(), []).append(item)

    def pop(self, item: Any, closing: Callable[[bool], None]) -> None:
        me = threading.get_ident()
        with self._lock:
            mine = self._by.get(me, [])
            if item in mine:
                mine.remove(item)
            if not mine:
                self._by.pop(me, None)
            closing(not self._by)

    def mine(self) -> list[Any]:
        """This thread's open blocks, innermost last (empty: none)."""
        return self._by.get(threading.get_ident(), [])

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        me = threading.get_ident()
        for thread in [t for t in self._by if t != me]:
            del self._by[thread]
