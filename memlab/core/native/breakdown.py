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
_ACTIVATION, _OTHER = _INDEX[Category.ACTIVATION], _INDEX[Category.OTHER]
#: One zero of each kind the timeline's arrays hold (repeated to their length).
_ZEROS: tuple[Any, Any, Any] = (array("q", [0]), array("d", [0.0]), array("b", [0]))


# Arrays the library writes into and reads from, kept by name (one native region at a time),
# each set grown together to the next power of two it needs: [length, array, ...].
_BUFFERS: dict[str, list[Any]] = {}
_OUT = (ctypes.c_int64 * 5)()
_CATS = (ctypes.c_int64 * (3 * _N))()
_I64, _SSIZE, _SIZE = ctypes.c_int64, ctypes.c_ssize_t, ctypes.c_size_t


def _buffers(name: str, n: int, *kinds: Any) -> list[Any]:
    kept = _BUFFERS.get(name)
    if kept is None or kept[0] < n:
        length = max(16, 1 << (max(n, 1) - 1).bit_length())
        kept = _BUFFERS[name] = [length, *((kind * length)() for kind in kinds)]
    return kept


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
    activation = _ACTIVATION
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
    n = lib.mn_marks_count()
    if n:
        _, weak, codes = _buffers("marks", n, _SSIZE, _I64)
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
    n = lib.mn_older_count()
    kinds = (_SSIZE, _SIZE, _I64, _I64, _I64, _I64, _I64)
    _, weak, ptrs, sizes, read, marks, older_codes, saved_end = _buffers("older", n, *kinds)
    if n:
        n = lib.mn_older(weak, ptrs, sizes, read, marks, n)
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
    _, addresses, nbytes, known_codes = _buffers("known", m, _SIZE, _I64, _I64)
    for i, (ptr, size) in enumerate(known.items()):
        addresses[i], nbytes[i] = ptr, size
        known_codes[i] = _code(frees.freed_role.get(ptr))
    out, cats = _OUT, _CATS
    args = (addresses, m, nbytes, known_codes, older_codes, saved_end, n, int(t0 * 1e9))
    points = lib.mn_tally(*args, out, 5, cats)
    high, _, _, missing, unplaced = out[:]
    # what the region never touched: constant throughout, by the ledger's roles
    still, counted = _special_sums(ledger)
    rest = ledger.total(_CPU) - counted
    special = ledger._special
    activation = _ACTIVATION
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
    still[_OTHER] += rest
    before = before_base + frees.discovered  # (storages found here existed all along)
    row = cats[:]
    # in Category's order, as the dispatch mode's tallies list them; categories at 0 left out
    peak_row = {c: v for c, i in _ORDER if (v := row[i] + still[i])}
    end_row = {c: v for c, i in _ORDER if (v := row[_N + i] + still[i])}
    high_row = {c: v for c, i in _ORDER if (v := row[2 * _N + i] + still[i])}

    # the timeline's points, written by the library straight into the arrays the Tally keeps
    totals: array[int] = _ZEROS[0] * points
    times: array[float] = _ZEROS[1] * points
    phases: array[int] = _ZEROS[2] * points
    if points:
        at = (totals.buffer_info()[0], times.buffer_info()[0], phases.buffer_info()[0])
        lib.mn_points(*at, points, before)
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
