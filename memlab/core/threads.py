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
        self._shared: set[int] = set()  # threads that have another's blocks (`share`)
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # (POSIX)
            os.register_at_fork(after_in_child=self._after_fork)

    def push(self, item: Any, opening: Callable[[bool], None]) -> None:
        me = threading.get_ident()
        with self._lock:
            opening(not self._by)
            if me in self._shared:  # (its own block: no longer the one it was given)
                self._shared.discard(me)
                self._by[me] = list(self._by[me])
            self._by.setdefault(me, []).append(item)

    def pop(self, item: Any, closing: Callable[[bool], None]) -> None:
        me = threading.get_ident()
        with self._lock:
            mine = self._by.get(me, [])
            if item in mine:
                mine.remove(item)
            if not mine:  # (and the threads it was given to)
                for thread in [t for t, blocks in self._by.items() if blocks is mine or t == me]:
                    del self._by[thread]
                    self._shared.discard(thread)
            closing(not self._by)

    def share(self, owner: int) -> None:
        """This thread has the blocks the thread ``owner`` has open, as long as that one does
        (a thread started inside a region is part of it)."""
        me = threading.get_ident()
        with self._lock:
            blocks = self._by.get(owner)
            if blocks and me != owner and me not in self._by:
                self._by[me] = blocks
                self._shared.add(me)

    def mine(self) -> list[Any]:
        """This thread's open blocks, innermost last (empty: none)."""
        return self._by.get(threading.get_ident(), [])

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        me = threading.get_ident()
        for thread in [t for t in self._by if t != me]:
            del self._by[thread]
        if me in self._shared:  # (the forking thread's own now)
            self._by[me] = list(self._by[me])
        self._shared.clear()
