"""The C signatures of the native record's functions (see record.cpp), for ctypes."""

from __future__ import annotations

import ctypes


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


#: The calls that open and close each region: no Python code, no wait for another thread but
#: the record's own lock, whose holders never wait for the GIL; microseconds for a cell's region
#: (the first after a region of millions of events lets go of them: milliseconds).
QUICK = ("mn_begin", "mn_end", "mn_release")


def quick(lib: ctypes.CDLL, path: str) -> ctypes.CDLL:
    """``lib`` with its `QUICK` calls made through ``ctypes.PyDLL``, which keeps the GIL: a call
    that lets it go waits to take it back behind every other thread that wants it (IPython's
    history thread, after each cell), which costs a region more than the call itself."""
    held = declare(ctypes.PyDLL(path))
    for name in QUICK:
        setattr(lib, name, getattr(held, name))
    return lib
