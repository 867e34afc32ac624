"""What a native region hands the ledger from the record: the storages its ops read that
predate it, and the storages its ops returned that are alive."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from typing import Any

import torch

from memlab.core._torch_record import storage_from_weak
from memlab.core.collector import hold_collector
from memlab.core.ledger import Entry, Ledger
from memlab.core.native.frees import ON_CPU
from memlab.core.native.objects import HANDED, saved_aliases
from memlab.core.native.signatures import sized


def reads(lib: Any, n: int) -> Iterator[tuple[torch.UntypedStorage | None, int, int]]:
    """The storages the region's ops read that predate it (at most ``n``): each one (None where
    it died since), its address and its size when read."""
    if not n:
        return
    weak = (ctypes.c_ssize_t * n)()
    ptrs = (ctypes.c_size_t * n)()
    sizes = (ctypes.c_int64 * n)()
    for i in range(lib.mn_reads(weak, ptrs, sizes, n)):
        yield storage_from_weak(weak[i]), ptrs[i], sizes[i]


def hand_over(lib: Any, ledger: Ledger, handed: dict[int, int], aliases: bool) -> None:
    """`NativeRegion.hand_over`: the older storages the region's ops read that the ledger does
    not know (into ``handed``, address -> bytes) and the survivors, registered now; with
    ``aliases``, what autograd holds saved too."""
    counts = (ctypes.c_int64 * 7)()
    lib.mn_counts(counts, len(counts))
    n_reads, n_alive = counts[3], counts[5]
    lib = sized(lib, counts[0] + counts[2] + n_reads)
    with ledger._lock:
        ledger.settle()
        for storage, ptr, size in reads(lib, n_reads):
            if storage is not None and not ledger.knows(storage):
                ledger.existing(ON_CPU, storage, size)
                handed[ptr] = size
        register_survivors(lib, ledger, n_alive)
        if aliases:  # what autograd holds saved, as the ledger sees it
            hand_over_aliases(lib, ledger)


def register_survivors(lib: Any, ledger: Ledger, n: int) -> list[Entry]:
    """The storages the region's ops returned that are alive (at most ``n``) into the ledger:
    new memory, or grown. Returns their entries. Where they are many, Python's collector is
    held off meanwhile (the entries made are no garbage, but each of its full passes walks
    every object made so far: half the time of 100,000 survivors), then left as it was."""
    if not n:
        return []
    weak = (ctypes.c_ssize_t * n)()
    sizes = (ctypes.c_int64 * n)()
    when = time.perf_counter()
    entries = []
    release = hold_collector(n > _MANY)
    try:
        for i in range(lib.mn_survivors(weak, sizes, n)):
            storage = storage_from_weak(weak[i])
            if storage is not None:
                entries.append(ledger.produced(ON_CPU, storage, when))
    finally:
        release()
    return entries


#: Survivors past which the collector is held off while they are registered.
_MANY = 10_000


def unplaced_notes(missing: int, unplaced: int) -> list[str]:
    """What the report says of frees the record could not place in its order."""
    notes = []
    if missing:
        notes.append(
            f"{missing:,} B freed here belonged to tensors made before memlab's native "
            "record started; those frees are counted at the region's end, so the peak may "
            "be higher than it was"
        )
    if unplaced:
        notes.append(
            f"{unplaced:,} B of memory from outside PyTorch's allocator (numpy arrays, "
            "file mappings, shared memory) came and went inside the region; its free is "
            "counted at the region's end, so the peak may be higher than it was"
        )
    return notes


def hand_over_aliases(lib: Any, ledger: Ledger) -> None:
    """The saved aliases of the region's that autograd still holds, to the ledger, which
    follows them from here (each once: not those a nested region's accountant handed it)."""
    for alias in saved_aliases(int(lib.mn_alias_count())):
        if alias not in HANDED:
            ledger.saved_by(alias, alias)
