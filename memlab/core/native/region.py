"""A region measured by the native record: tensor accounting's figures without Python per op.

``NativeRegion`` stands in for a `memlab.core.recorder.Recorder` (start, set_origin, stop,
tally) on the CPU. During the region no Python of memlab's runs per op; the native library logs
each allocation and free and which storages ops returned and read. With a breakdown or a
timeline (`memlab.core.native.roles`) a few hooks tell it roles and phases, and it logs each
event's time and phase and what autograd saves. At the end the region is settled in one pass
("categorised once per step"; the breakdown's replay: `memlab.core.native.breakdown`):

* the storages ops returned that are still alive are registered in the ledger (new memory);
* the storages ops read that predate the region and that the ledger did not follow are
  registered as having existed all along (they raise every figure, the start included), as
  the dispatch mode's accounting registers them;
* the peak is the highest running total over the allocations ops returned, their frees, and
  the frees of storages the ledger followed, each at its place in the allocator's order.

A storage the ledger followed whose memory came from before the native record was first
installed has no place in that order: its free is counted at the region's end (the peak is
never too low), and the report says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memlab.core import older_graphs, resizes
from memlab.core._torch_record import restore_stance, storage_address, unseen
from memlab.core.interrupts import held_interrupts
from memlab.core.ledger import Ledger
from memlab.core.native import breakdown, handover, joiner, library
from memlab.core.native.eligible import NativeNotStartedError, eager, modes_left_on
from memlab.core.native.frees import ON_CPU, Frees
from memlab.core.native.roles import NativeRoles, roles_for
from memlab.core.native.signatures import SMALL, sized
from memlab.core.recorder import Tally
from memlab.core.resizes import following_resizes
from memlab.core.storages import address_of, follow_addresses

_CPU = "cpu"
#: Events the record keeps per region (about 40 bytes each); beyond them the region is lost.
MAX_EVENTS = 10_000_000
#: Events past which a region's settling holds Ctrl-C off until it is done (`held_interrupts`).
HOLD_AFTER = SMALL
# Buffers the library writes into (one region at a time, under its lock).
_COUNTS = (ctypes.c_int64 * 7)()
_OUT = (ctypes.c_int64 * 5)()
_NO_ADDRESSES, _NO_BYTES = (ctypes.c_size_t * 1)(), (ctypes.c_int64 * 1)()


#: The native region open now, if any (the library records one at a time, process-wide).
_OPEN: list[NativeRegion] = []


def hand_over_open() -> None:
    """A region measured by the dispatch mode is opening while a native one is open (nested in
    it, or on another thread): the native region hands what it found so far (the storages its
    ops returned that are alive, the older ones they read) to the ledger now, so that the new
    region starts from a ledger that holds them, as under the dispatch mode it would."""
    if _OPEN:
        _OPEN[0].hand_over()


class NativeRegion:
    """One CPU region measured by the native record. ``open`` returns None where it cannot
    start (another native region is open, or the allocator was replaced by other code): the
    caller then measures with the dispatch mode."""

    device = _CPU

    def __init__(self, ledger: Ledger, lib: Any, roles: NativeRoles | None = None) -> None:
        self.ledger = ledger
        self._lib = lib
        #: With a breakdown (and a timeline): the hooks that tell the record roles and phases.
        self.roles = roles
        #: What the region watches (`memlab.track`'s ``watch``), looked at at each end.
        self.watched: Callable[[], Iterable[Any]] = tuple
        self._t0, self._saved = 0.0, True
        self._frees: Frees | None = None
        self._open = False
        self.before = 0
        self._tally: Tally | None = None
        self.notes: list[str] = []
        #: Events the record could not keep (its log was full): the figures may be short.
        self.lost = 0
        self._stance: Any = None
        self._resizing: Any = None
        self._unjoin: Callable[[], list[str]] = list  # (see `joiner.follow`)
        #: Address -> bytes of the older storages handed to the ledger before the end (see
        #: `hand_over`): counted in `before` then, so not again if they die in the region.
        self._handed: dict[int, int] = {}
        self._failures = 0  # (the ledger's listeners' failures before the region)

    @classmethod
    def open(cls, ledger: Ledger, keep: bool = False, saved: bool = True) -> NativeRegion | None:
        """``keep``: with a timeline (and the categories); ``saved``: tag what autograd saves
        (a breakdown's activations)."""
        lib = library()
        if lib is None:
            return None
        region = cls(ledger, lib, roles_for(ledger, lib) if keep else None)
        region._saved = saved
        return region

    # -- the Recorder's lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        ledger = self.ledger
        roles, watched = self.roles, []
        if roles is not None:  # (a new region's notes, the older graphs' among them)
            roles.errors = []
            watched = roles.first_look(self.watched(), self._saved)
        with ledger._lock:  # one lock for what `total`, `next_serial` and `attach` each do
            ledger.settle()
            self.before, self._failures = ledger._totals.get(_CPU, 0), ledger.failures
            frees = self._frees = Frees(ledger, next(ledger._serials))
            ledger._listeners.append(frees)
        resizing = following_resizes(self._resized)
        try:
            resizing.__enter__()
            try:
                self._stance = eager()
                code = self._lib.mn_begin(MAX_EVENTS, id(ledger), int(self.roles is not None))
                if code != 0:
                    restore_stance(self._stance)
                    raise NativeNotStartedError(code)
            except BaseException:
                resizing.__exit__(None, None, None)
                raise
        except BaseException:
            ledger.detach(frees)
            raise
        self._resizing = resizing
        self._open = True
        self._unjoin = joiner.follow(self._lib)
        _OPEN[:] = [self]
        follow_addresses(self.ledger._entries.values())
        if self.roles is not None:
            try:
                if self._saved:  # older graphs found released while open: logged then
                    older_graphs.LISTENERS.append(self._unsaved)
                self.roles.install(self._saved)
                self.roles.watch(watched)
            except BaseException:
                self._close_record()
                self._done(frees)
                raise

    def _unsaved(self, storage: torch.UntypedStorage) -> None:
        self._lib.mn_unsaved(storage_address(storage))

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """``storage.resize_()`` ran (outside the dispatcher): placed in the record's order."""
        added = storage.nbytes() - before
        ptr = resizes.before_ptr
        if self._lib.mn_resized(ptr, address_of(storage), added, storage_address(storage)):
            return  # a storage of this region's: the record follows it to its new memory
        if self._frees is not None and not self.ledger.knows(storage):
            self._frees.found_at.add(resizes.before_ptr)  # found now, at its old address
        self.ledger.resized(storage, before)  # one new to it: found at its old size

    def set_origin(self, t0: float) -> None:
        self._t0 = t0

    def stop(self) -> None:
        """Ends the record and settles the region; safe to call again after a Ctrl-C cut it
        short (the settling is done again, and registering a storage twice is a no-op)."""
        frees = self._frees
        if frees is None or self._tally is not None:
            return
        if self._open:
            self._close_record()
            self.notes += joiner.others_note(self._lib) + modes_left_on()
        counts = _COUNTS
        self._lib.mn_counts(counts, len(counts))
        big = counts[0] + counts[2] + counts[3] > HOLD_AFTER  # (allocations, frees, reads)
        try:  # a big region's settling is not cut by a Ctrl-C: it comes after (once, not again)
            with held_interrupts() if big else contextlib.nullcontext():
                self._tally = self._settle(self._lib, frees, counts)
        except BaseException as e:
            if self._tally is not None:  # settled: what came after it (a Ctrl-C held off) goes on
                self._finish(frees)
            elif not isinstance(e, KeyboardInterrupt):
                self._done(frees)
            raise  # (a Ctrl-C that cut it: record and listener stay; `track` closes again)
        self._finish(frees)

    def _finish(self, frees: Frees) -> None:
        self._done(frees)
        self.watched = tuple  # (the front end's method: no cycle keeps the two alive)
        self.lost += self.ledger.missed_since(self._failures, self.notes)

    def _close_record(self) -> None:
        self._open = False
        try:
            if self.roles is not None:
                try:
                    if self._saved:
                        older_graphs.released()
                finally:
                    with contextlib.suppress(ValueError):
                        older_graphs.LISTENERS.remove(self._unsaved)
                    self.roles.uninstall()
        finally:
            self.notes += self._unjoin()
            self._lib.mn_end()
            try:
                restore_stance(self._stance)
            finally:
                resizing, self._resizing = self._resizing, None
                resizing.__exit__(None, None, None)  # (dropped: it holds this region)

    def _done(self, frees: Frees) -> None:
        if _OPEN and _OPEN[0] is self:
            _OPEN.clear()
        try:
            self.ledger.detach(frees)
        finally:
            self._lib.mn_release()  # the next region may start

    def hand_over(self) -> None:
        """Registers in the ledger, now, the storages the region's ops returned that are alive
        and the older ones they read (see `hand_over_open`); the region's own figures are the
        same (it registers them again at its end, which is then a no-op)."""
        if self._open:
            handover.hand_over(self._lib, self.ledger, self._handed, self.roles is not None)

    def tally(self, breakdown: bool, used: Any = ()) -> Tally:
        tally = self._tally
        if tally is None:
            raise RuntimeError("the native record's region was not closed")
        if not breakdown and tally.at_peak is not None:  # a timeline alone
            return dataclasses.replace(tally, at_peak=None, at_end=None, highest=None)
        return tally

    # -- the one pass at the end --------------------------------------------------------------
    def _settle(self, lib: Any, frees: Frees, counts: Any) -> Tally:
        ledger = self.ledger
        n_allocs, _, n_frees, n_reads, overflow, n_alive, transformed = counts
        lib = sized(lib, n_allocs + n_frees + n_reads)  # (a small region's calls keep the GIL)
        if overflow:
            self.lost += 1
            self.notes.append(
                f"the native record's log was full ({MAX_EVENTS:,} events): figures may be "
                "short (set MEMLAB_NATIVE=0 to measure with the dispatch mode)"
            )
        if transformed:  # (the RecordFunction route, on a PyTorch without the dispatch key)
            self.lost += 1
            self.notes.append(
                "torch.func transforms (vmap, grad) ran here: the native record does not "
                "follow their ops on this PyTorch, so the figures may be short (set "
                "MEMLAB_NATIVE=0 to measure with the dispatch mode)"
            )
        dead_reads: dict[int, int] = {}
        with ledger._lock:
            ledger.settle()  # the region's frees of followed storages, heard by `frees`
            for storage, ptr, size in handover.reads(lib, n_reads):
                if storage is None:  # read, then freed in the region
                    if ptr in self._handed:  # counted in `before` when handed over
                        frees.freed.setdefault(ptr, size)
                    elif ptr not in frees.freed and ptr not in frees.found_at:
                        dead_reads[ptr] = size  # (found ones: in `before` already)
                else:  # registered if new to the ledger (heard by `frees`), at its size when
                    # read (an op may have grown it since: the ledger hears that as the op's,
                    # when the storage is registered as a survivor below)
                    ledger.existing(ON_CPU, storage, size)
            survivors = handover.register_survivors(lib, ledger, n_alive)
            known = {**frees.freed, **dead_reads}
            n = len(known)
            if self.roles is not None:
                # the roles alive now, once what the region made is in the ledger (a watched
                self.roles.watch(self.watched())  # tensor it made is not one from before it)
                with unseen():  # (as `watch`: the program's torch function modes see none of it)
                    self.roles.finish()
                self.notes.extend(e for e in self.roles.errors if e not in self.notes)
                base = self.before + sum(dead_reads.values())
                result, missing, unplaced = breakdown.tally(
                    lib, ledger, frees, known, survivors, base, self._t0
                )
                self.notes += handover.unplaced_notes(missing + frees.unplaced, unplaced)
                return result
            if n:
                addresses = (ctypes.c_size_t * n)(*known.keys())
                nbytes = (ctypes.c_int64 * n)(*known.values())
            else:
                addresses, nbytes = _NO_ADDRESSES, _NO_BYTES
            out = _OUT
            lib.mn_sweep(addresses, n, nbytes, out, len(out))
            high, _, _, missing, unplaced = out
            missing += frees.unplaced
            after = ledger.total(_CPU)
        before = self.before + frees.discovered + sum(dead_reads.values())
        self.notes += handover.unplaced_notes(missing, unplaced)
        return Tally(before, after, before + high, None, None, None, None, None, None)
