"""The C signatures of the native record's functions (see record.cpp), for ctypes."""

from __future__ import annotations

import ctypes
from typing import Any


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The library's functions, with their C signatures (and its version checked)."""
    i64, i64p = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
    up, ipp = ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_ssize_t)
    lib.mn_version.restype = ctypes.c_int
    lib.mn_begin.argtypes = [i64, i64, ctypes.c_int]
    lib.mn_begin.restype = ctypes.c_int
    lib.mn_end.argtypes = []
    lib.mn_end.restype = None
    lib.mn_counts.argtypes = [i64p, i64]
    lib.mn_counts.restype = None
    lib.mn_sweep.argtypes = [up, i64, i64p, i64p, i64]
    lib.mn_sweep.restype = None
    lib.mn_survivors.argtypes = [ipp, i64p, i64]
    lib.mn_survivors.restype = i64
    lib.mn_reads.argtypes = [ipp, up, i64p, i64]
    lib.mn_reads.restype = i64
    lib.mn_resized.argtypes = [ctypes.c_size_t, ctypes.c_size_t, i64, ctypes.c_ssize_t]
    lib.mn_resized.restype = ctypes.c_int
    lib.mn_unfollowed.argtypes = []
    lib.mn_unfollowed.restype = i64
    lib.mn_foreign.argtypes = [i64p]
    lib.mn_foreign.restype = None
    lib.mn_release.argtypes = []
    lib.mn_release.restype = None
    lib.mn_follows.argtypes = [ctypes.c_size_t]
    lib.mn_follows.restype = ctypes.c_int
    lib.mn_install.argtypes = []
    lib.mn_install.restype = ctypes.c_int
    lib.mn_uninstall.argtypes = [ctypes.c_int]
    lib.mn_uninstall.restype = ctypes.c_int
    lib.mn_thread_join.argtypes = []
    lib.mn_thread_join.restype = ctypes.c_int
    lib.mn_route.argtypes = []
    lib.mn_route.restype = ctypes.c_int
    lib.mn_prefer_records.argtypes = [ctypes.c_int]
    lib.mn_prefer_records.restype = None
    lib.mn_saved_op.argtypes = []
    lib.mn_saved_op.restype = ctypes.c_int
    lib.mn_mark.argtypes = [ctypes.c_ssize_t, ctypes.c_int]
    lib.mn_mark.restype = None
    lib.mn_unsaved.argtypes = [ctypes.c_ssize_t]
    lib.mn_unsaved.restype = None
    lib.mn_older.argtypes = [ipp, up, i64p, i64p, i64p, i64]
    lib.mn_older.restype = i64
    lib.mn_sticky.argtypes = [ctypes.c_ssize_t, ctypes.c_int]
    lib.mn_sticky.restype = None
    lib.mn_older_count.argtypes = []
    lib.mn_older_count.restype = i64
    lib.mn_marks.argtypes = [ipp, i64p, i64]
    lib.mn_marks.restype = i64
    lib.mn_marks_count.argtypes = []
    lib.mn_marks_count.restype = i64
    lib.mn_mark_grads.argtypes = []
    lib.mn_mark_grads.restype = None
    lib.mn_typed_count.argtypes = []
    lib.mn_typed_count.restype = i64
    lib.mn_alias_count.argtypes = []
    lib.mn_alias_count.restype = i64
    lib.mn_tally.argtypes = [up, i64, i64p, i64p, i64p, i64p, i64, i64, i64p, i64, i64p]
    lib.mn_tally.restype = i64
    # (the addresses of the arrays it fills: int64, double and int8)
    lib.mn_points.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, i64, i64]
    lib.mn_points.restype = i64
    lib.mn_plain.argtypes = [ctypes.c_ssize_t]
    lib.mn_plain.restype = None
    if lib.mn_version() != 8:
        raise RuntimeError("a memlab native library of another version was loaded")
    return lib


#: The calls whose time grows with the region's events (or that register with PyTorch's
#: dispatcher): through ctypes.CDLL, which lets other threads run meanwhile, after a region of
#: more than `SMALL` events (see `sized`). Every other call is brief (no Python code, no wait
#: but for the record's own lock, whose holders never wait for the GIL) and keeps the GIL.
LONG = (
    "mn_sweep",
    "mn_tally",
    "mn_survivors",
    "mn_reads",
    "mn_older",
    "mn_marks",
    "mn_points",
    "mn_install",
    "mn_uninstall",
    "mn_saved_op",
)
#: Events (allocations, frees, reads) up to which a region's long calls keep the GIL too:
#: about a millisecond of work in the library.
SMALL = 1 << 15


def quick(lib: ctypes.CDLL, path: str) -> ctypes.CDLL:
    """``lib`` with its brief calls made through ``ctypes.PyDLL``, which keeps the GIL: a call
    that lets it go waits to take it back behind every other thread that wants it (IPython's
    history thread after each cell, a kernel's output thread), which costs a cell's region
    more than the calls themselves (about 100 µs). ``lib.held`` has every call so (`sized`)."""
    held = declare(ctypes.PyDLL(path))
    for name in [n for n in vars(lib) if n.startswith("mn_") and n not in LONG]:
        setattr(lib, name, getattr(held, name))
    lib.held = held  # type: ignore[attr-defined]
    return lib


def sized(lib: Any, events: int) -> Any:
    """The library whose `LONG` calls keep the GIL where the region was small (``events``),
    else ``lib`` itself (they let it go)."""
    return getattr(lib, "held", lib) if events <= SMALL else lib
