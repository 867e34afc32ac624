"""A native region's breakdown and timeline, settled once at its end.

The library replays the region's events in C++ (`mn_tally`): each allocation and free of a
storage an op returned, each free of a storage the ledger followed, each saving for backward
and each end of one, with each storage's role. Python supplies what the ledger knows: the
roles of the storages from before the region that it touched, and what the storages it never
touched add up to (constant through the region, summed once as `memlab.core.recorder` does).
"""

from __future__ import annotations

import ctypes
import weakref
from array import array
from typing import Any

from memlab.core._torch_record import storage_address, storage_from_weak
from memlab.core.categories import STICKY, Category
from memlab.core.ledger import Entry, Ledger
from memlab.core.native.frees import ON_CPU, Frees
from memlab.core.native.handover import hand_over_aliases
from memlab.core.native.roles import CATEGORY, CODE
from memlab.core.recorder import Tally

_CPU = "cpu"
_N = 12  # categories the library sums (codes 1..12)
#: Category by the library's index (code - 1).
_BY_INDEX = [CATEGORY[i + 1] for i in range(_N)]
_INDEX = {c: i for i, c in enumerate(_BY_INDEX)}
#: (category, index) in the order of `Category`, as the dispatch mode's tallies list them.
_ORDER = [(c, _INDEX[c]) for c in Category if c in _INDEX]


# Buffers the library writes into and reads from, kept (one native region at a time), each
# grown to the next power of two it needs.
_BUFFERS: dict[int, Any] = {}
_OUT = (ctypes.c_int64 * 5)()
_CATS = (ctypes.c_int64 * (3 * _N))()


def _buffer(kind: Any, slot: int, n: int) -> Any:
    """Buffer number ``slot`` (each use its own: c_ssize_t and c_int64 are one type here)."""
    buf = _BUFFERS.get(slot)
    if buf is None or len(buf) < n:
        buf = _BUFFERS[slot] = (kind * max(16, 1 << (n - 1).bit_length()))()
    return buf


def _code(category: Category | None) -> int:
    return 0 if category is None else CODE[category]


def _stronger(a: int, b: int) -> int:
    if a == 0:
        return b
    return a if b == 0 or a < b else b


def _special_sums(ledger: Ledger) -> tuple[list[int], int]:
    """Bytes of the ledger's CPU storages with a role (or saved), by the library's category
    index, and their sum: summed again only where the ledger changed them since the last
    region (a training step's parameters and optimizer state stay as they were)."""
    version = ledger.special_version
    cached = _SUMS.get(id(ledger))
    if cached is not None and cached[0] == version and cached[1]() is ledger:
        return list(cached[2]), cached[3]
    still = [0] * _N
    counted = 0
    activation = _INDEX[Category.ACTIVATION]
    for entry in list(ledger._special.values()):
        if entry.device != _CPU:
            continue
        role = entry.category
        if role is not None:
            still[_INDEX[role]] += entry.nbytes
        elif entry.saved:
            still[activation] += entry.nbytes
        else:
            continue
        counted += entry.nbytes
    _SUMS.clear()  # (one ledger in practice: the process's)
    _SUMS[id(ledger)] = (version, weakref.ref(ledger), tuple(still), counted)
    return still, counted


_SUMS: dict[int, tuple[int, Any, tuple[int, ...], int]] = {}


def tally(
    lib: Any,
    ledger: Ledger,
    frees: Frees,
    known: dict[int, int],
    survivors: list[Entry],
    before_base: int,
    t0: float,
) -> tuple[Tally, int, int]:
    """The region's Tally (called under the ledger's lock, once the storages it read and the
    ones its ops returned are in the ledger), and the figures mn_sweep would give: bytes of
    known frees not found, bytes of adopted storages not placed."""
    touched: dict[int, Entry] = {e.serial: e for e in survivors}
    # roles given in the region: the lasting ones into the ledger, for the storages alive
    n = int(lib.mn_marks_count())
    if n:
        weak = _buffer(ctypes.c_ssize_t, 0, n)
        codes = _buffer(ctypes.c_int64, 1, n)
        for i in range(lib.mn_marks(weak, codes, n)):
            storage = storage_from_weak(weak[i])
            category = CATEGORY.get(int(codes[i]))
            if storage is not None and category in STICKY:
                ledger.classify(ON_CPU, category, storage)
                lib.mn_sticky(storage_address(storage), CODE[category])
    # saved aliases autograd still holds: the ledger follows them from here
    hand_over_aliases(lib, ledger)
    ledger.settle()
    # the storages from before the region that it touched: their roles, from the ledger
    n = int(lib.mn_older_count())
    older_codes = _buffer(ctypes.c_int64, 2, n)
    saved_end = _buffer(ctypes.c_int64, 3, n)
    if n:
        weak = _buffer(ctypes.c_ssize_t, 4, n)
        ptrs = _buffer(ctypes.c_size_t, 5, n)
        sizes = _buffer(ctypes.c_int64, 6, n)
        read = _buffer(ctypes.c_int64, 7, n)
        marks = _buffer(ctypes.c_int64, 8, n)
        n = int(lib.mn_older(weak, ptrs, sizes, read, marks, n))
        for i in range(n):
            storage = storage_from_weak(weak[i])
            code = int(marks[i])
            if storage is not None:
                entry = ledger.existing(ON_CPU, storage, sizes[i])
                touched[entry.serial] = entry
                older_codes[i] = _stronger(code, _code(entry.category))
                saved_end[i] = entry.saved
                if entry.category in STICKY:  # the next regions sum it from the ledger
                    lib.mn_sticky(storage_address(storage), CODE[entry.category])
            else:
                ptr = ptrs[i]
                older_codes[i] = _stronger(code, _code(frees.freed_role.get(ptr)))
                saved_end[i] = 0
                if ptr not in known and ptr not in frees.found_at:
                    # given a role or saved, then freed, never followed by the ledger: it
                    # existed at the start, and its free is placed by its block
                    known = {**known, ptr: sizes[i]}
                    before_base += sizes[i]
    m = len(known)
    addresses = _buffer(ctypes.c_size_t, 9, m)
    nbytes = _buffer(ctypes.c_int64, 10, m)
    known_codes = _buffer(ctypes.c_int64, 11, m)
    for i, (ptr, size) in enumerate(known.items()):
        addresses[i], nbytes[i] = ptr, size
        known_codes[i] = _code(frees.freed_role.get(ptr))
    out, cats = _OUT, _CATS
    points = int(
        lib.mn_tally(
            addresses,
            m,
            nbytes,
            known_codes,
            older_codes,
            saved_end,
            n,
            int(t0 * 1e9),
            out,
            5,
            cats,
        )
    )
    high, _, _, missing, unplaced = out
    # what the region never touched: constant throughout, by the ledger's roles
    still, counted = _special_sums(ledger)
    rest = ledger.total(_CPU) - counted
    special = ledger._special
    activation = _INDEX[Category.ACTIVATION]
    for entry in touched.values():
        if entry.alive:
            rest -= entry.nbytes
        if entry.device == _CPU and special.get(entry.serial) is entry:  # not untouched
            role = entry.category
            if role is not None:
                still[_INDEX[role]] -= entry.nbytes
            elif entry.saved:
                still[activation] -= entry.nbytes
            else:
                continue
            rest += entry.nbytes
    still[_INDEX[Category.OTHER]] += rest
    before = before_base + frees.discovered  # (storages found here existed all along)
    row = list(cats)
    peak_row, end_row, high_row = {}, {}, {}
    for c, i in _ORDER:  # in Category's order, as the dispatch mode's tallies list them
        base = still[i]
        if row[i] + base:
            peak_row[c] = row[i] + base
        if row[_N + i] + base:
            end_row[c] = row[_N + i] + base
        if row[2 * _N + i] + base:
            high_row[c] = row[2 * _N + i] + base

    totals: array[int] = array("q")
    times: array[float] = array("d")
    phases: array[int] = array("b")
    if points:
        t_buf = _buffer(ctypes.c_int64, 12, points)
        s_buf = _buffer(ctypes.c_double, 13, points)
        p_buf = _buffer(ctypes.c_int8, 14, points)
        lib.mn_points(t_buf, s_buf, p_buf, points, before)
        totals.frombytes(memoryview(t_buf).cast("B")[: 8 * points])
        times.frombytes(memoryview(s_buf).cast("B")[: 8 * points])
        phases.frombytes(memoryview(p_buf).cast("B")[:points])
    result = Tally(
        before,
        ledger.total(_CPU),
        before + high,
        peak_row,
        end_row,
        high_row,
        times,
        totals,
        phases,
    )
    return result, missing, unplaced
