"""Threads started while a CPU region is open join it: the native record follows their ops too.

The record sees an op where its dispatch key is included on the op's thread, and a region
includes it on the thread that opens it. A thread the region's code starts (``threading.Thread``:
``model.generate`` run beside a streamer, a worker of the program's own) joins through the
profile hook ``threading`` hands each thread it starts (`threading.setprofile`): on the thread's
first call the hook includes the key there and gives the thread the hook it would have had
otherwise (the program's own, usually none). A thread started before the region is not
followed; one that outlives the region drops the key at its next op (record.cpp,
``mode_fallback``). Where a new thread cannot join (the record's RecordFunction route; a region
the dispatch mode measures, whose mode is its own thread's), the region counts such threads and
says so."""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any

from memlab.core import kv_caches


class _Follower:
    def __init__(self, lib: Any) -> None:
        self.lib = lib  # the native region's library; None: a dispatch-mode region
        self.missed = 0  # threads started that it does not follow
        self.owner = threading.get_ident()  # the region's thread


#: The open regions' followers (nested regions each have one; the first keeps the hook the
#: threading module had before them), under one lock.
_OPEN: list[_Follower] = []
_BEFORE: list[Any] = [None]
_lock = threading.Lock()


def _join(frame: Any, event: str, arg: Any) -> None:
    """A new thread's profile hook: runs once, at the thread's first call."""
    before = _BEFORE[0]
    sys.setprofile(before)
    with _lock:
        followers = list(_OPEN)
    for follower in followers:
        try:
            joined = follower.lib is not None and bool(follower.lib.mn_thread_join())
        except Exception:  # never the program's thread's error: the region says it missed it
            joined = False
        follower.missed += not joined
        if joined:  # part of the region: the caches it fills are named for it too
            kv_caches.adopt(follower.owner)
    if before is not None:  # the program's hook sees this first call too
        before(frame, event, arg)


def follow(lib: Any) -> Callable[[], list[str]]:
    """New threads join the open region from now on (``lib``: the native record's; None for a
    region the dispatch mode measures, which follows its own thread only); returns what stops
    that, which gives the region's note on the threads it did not follow. The threading
    module's hook is put back after the last region where it is still ours (a hook the code
    set meanwhile stays)."""
    follower = _Follower(lib)
    with _lock:
        if not _OPEN:
            _BEFORE[0] = threading.getprofile()
            threading.setprofile(_join)
        _OPEN.append(follower)

    def stop() -> list[str]:
        with _lock:
            if follower in _OPEN:
                _OPEN.remove(follower)
                if not _OPEN and threading.getprofile() is _join:
                    threading.setprofile(_BEFORE[0])
        if not follower.missed:
            return []
        how = (
            "the dispatch mode follows the region's own thread only"
            if lib is None
            else "the native record does not follow them on this PyTorch"
        )
        return [
            f"{follower.missed} thread(s) started here ran outside the accounting ({how}): "
            "the tensors they made are not counted"
        ]

    return stop


#: What ``mn_foreign`` writes: [blocks, bytes] (one region at a time closes).
_FOREIGN = (ctypes.c_int64 * 2)()


def others_note(lib: Any) -> list[str]:
    """The note on the memory threads the record does not follow allocated in the region just
    closed and left alive (a thread started before it: it follows its own thread and the ones
    it starts): not in the figures. Read after the record's end (``mn_end``)."""
    out = _FOREIGN
    lib.mn_foreign(out)
    blocks, nbytes = out
    if not blocks:
        return []
    return [
        f"{nbytes:,} bytes in {blocks:,} block(s) another thread allocated here and still holds "
        "are not counted: the record follows the region's own thread and the threads it "
        "starts, not one started before it"
    ]
