"""The ledger: every live tensor storage memlab has seen, followed to its free by a weak reference.

A storage is identified by its Python object, which PyTorch keeps alive exactly as long as the
storage itself (views share it), so a weak reference's callback fires when the memory is freed.
Entries hold weak references only: the ledger never keeps a tensor alive.

The callbacks only queue the dead reference (``deque.append``, which runs no Python code, so a
Ctrl-C cannot land in it and be lost); the ledger settles the queue, in order, before it answers
any question or registers any storage. Settling is safe to interrupt: it finishes the queue and
then raises the interrupt in the code that was running.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque
from typing import Any

import torch

from memlab.core.categories import STICKY, Category, stronger
from memlab.core.fakes import Fakes
from memlab.core.listeners import Listeners
from memlab.core.storages import Entry, PackRef, StorageRef, device_key, storage_of

__all__ = ["Entry", "Ledger", "default_ledger", "device_key", "storage_of"]


class Ledger(Listeners):
    """Live storages by identity, with per-device byte totals.

    Thread-safe: autograd runs CUDA backward on its own threads, and weak-reference callbacks run
    wherever the last reference dies. (``native_roles``: the native record's role hooks for it.)
    """

    def __init__(self) -> None:
        self._entries: dict[int, Entry] = {}
        #: The storages seen resized in place (`resized`), by serial: the ones `resync` re-reads.
        self._resizing: dict[int, Entry] = {}
        self._totals: dict[str, int] = {}
        Listeners.__init__(self)
        self._serials = itertools.count()
        self._lock = threading.RLock()
        self._packs: dict[int, PackRef] = {}
        self._dead: deque[weakref.ref[object]] = deque()  # in the order they died
        self._when = 0.0
        #: Live entries by serial; those that ever had a role or were saved (reports sum the rest).
        self._by_serial: dict[int, Entry] = {}
        self._special: dict[int, Entry] = {}
        #: Bumped at each change to `_special` or its entries: sums over them stay right till then.
        self.special_version = 0
        self.native_roles: Any = None
        self.fakes = Fakes()  # fake tensors' entries: forgotten once their mode ends

    # -- queries ----------------------------------------------------------------------------
    def total(self, device: str) -> int:
        if self._dead:
            self.settle()
        return self._totals.get(device, 0)

    def next_serial(self) -> int:
        """Serials below this value belong to storages the ledger already knows."""
        with self._lock:
            self.settle()
            return next(self._serials)

    def entries(self, device: str) -> list[Entry]:
        with self._lock:
            self.settle()
            return [e for e in self._entries.values() if e.device == device]

    def serial_of(self, t: torch.Tensor) -> int | None:
        """The serial of ``t``'s storage if the ledger follows it; registers nothing and takes
        no lock (a listener may ask from inside a callback)."""
        storage = storage_of(t)
        entry = None if storage is None else self._entries.get(id(storage))
        return entry.serial if entry is not None and entry.ref() is storage else None

    def __len__(self) -> int:
        self.settle()
        return len(self._entries)

    def settle(self) -> None:
        """Take the frees (and ends of saving) that happened since the last call, in order. A
        KeyboardInterrupt while settling is raised once the queue is done."""
        interrupted: BaseException | None = None
        with self._lock:
            dead = self._dead
            while dead:
                try:
                    ref = dead[0]
                    if type(ref) is StorageRef:
                        self._freed(ref)
                    elif type(ref) is PackRef:
                        self._unsaved(ref)
                    dead.popleft()
                except KeyboardInterrupt as e:  # settle all first: the figures stay right
                    interrupted = e
        if interrupted is not None:
            raise interrupted

    # -- observations -----------------------------------------------------------------------
    def _add(self, storage: torch.UntypedStorage, nbytes: int, device: str) -> Entry:
        ref = StorageRef(storage, self._dead.append)
        ref.key = key = id(storage)
        entry = Entry(next(self._serials), ref, nbytes, device)
        totals = self._totals
        if device not in totals:
            totals[device] = 0
        # From here to the total, no call: Python delivers Ctrl-C at calls and loops, so an
        # interrupt cannot leave the entry known (its free counted) without its bytes counted.
        self._entries[key] = entry
        self._by_serial[entry.serial] = entry
        totals[device] += nbytes
        return entry

    def existing(self, t: torch.Tensor, storage: Any, nbytes: int | None = None) -> Entry:
        """``t``'s storage, alive before now; registered as pre-existing if new to us, at
        ``nbytes`` where given (its size when it was read), else at its size now."""
        if self._dead:  # first: a dead storage's id may be the new one's
            self.settle()
        key = id(storage)
        entry = self._entries.get(key)  # the common case, without the lock (atomic under the GIL)
        if entry is not None:
            return entry
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                # The tensor's device, not the storage's: a fake tensor's storage is on "meta".
                nbytes = storage.nbytes() if nbytes is None else nbytes
                entry = self._add(storage, nbytes, device_key(t.device))
                self.fakes.note(t, entry.serial)
                self._tell(entry.device, "on_discovered", entry.serial, entry.nbytes)
            return entry

    def produced(self, t: torch.Tensor, storage: torch.UntypedStorage, when: float) -> Entry:
        """``t``'s storage, returned by an op that started at ``when`` (perf_counter): new
        memory, or a known one that may have grown."""
        if self._dead:  # first: a dead storage's id may be the new one's
            self.settle()
        key = id(storage)
        nbytes = storage.nbytes()
        entry = self._entries.get(key)
        if entry is not None and entry.nbytes == nbytes:  # a view or an in-place result
            return entry
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._add(storage, nbytes, device_key(t.device))
                self.fakes.note(t, entry.serial)
                self._heard(entry, nbytes, when)
            elif entry.nbytes != nbytes:
                entry.relocate()  # grown (or shrunk) by an op: in a new block
                self._grew(entry, nbytes, when)
            return entry

    def knows(self, storage: torch.UntypedStorage) -> bool:  # (the ledger follows it)
        if self._dead:
            self.settle()
        return id(storage) in self._entries

    def resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """``storage.resize_()`` ran (FSDP frees and refills parameters this way, outside the
        dispatcher): its new size counts from now. One unknown to the ledger is registered as
        having existed at its size ``before``."""
        if self._dead:
            self.settle()
        with self._lock:
            entry = self._entries.get(id(storage))
            if entry is None:
                entry = self._add(storage, before, device_key(storage.device))
                self._tell(entry.device, "on_discovered", entry.serial, before)
            self._resizing[entry.serial] = entry
            entry.relocate()  # its memory moved
            self._grew(entry, storage.nbytes(), time.perf_counter())

    def resync(self) -> None:
        """Re-reads the size of each live storage seen resized in place (FSDP resizes the same
        parameters every step) while no region was open: only those (every storage, ~0.7 µs
        each, would cost 7 ms a cell with 10,000 alive). Fake tensors whose mode ended go."""
        with self._lock:
            self.settle()
            self.fakes.forget(self._by_serial, self._freed)
            now = time.perf_counter()
            for serial, entry in list(self._resizing.items()):
                storage = entry.ref() if entry.alive else None
                if storage is None:
                    del self._resizing[serial]
                    continue
                try:
                    nbytes = storage.nbytes()
                except RuntimeError:  # a storage that cannot say (it keeps its last size)
                    continue
                self._grew(entry, nbytes, now)

    def _grew(self, entry: Entry, nbytes: int, when: float) -> None:
        delta = nbytes - entry.nbytes
        if delta:
            entry.nbytes = nbytes
            self._totals[entry.device] += delta
            self.special_version += 1
            self._heard(entry, delta, when)

    def _heard(self, entry: Entry, delta: int, when: float) -> None:
        for listener in self._listeners:  # `_tell`, inline: the per-op path
            if listener.device == entry.device:
                try:
                    listener.on_alloc(entry.serial, delta, when)
                except Exception as e:
                    self._failed(listener, e)

    def classify(self, t: torch.Tensor, category: Category, storage: Any = None) -> None:
        """``t``'s storage (``storage`` where the caller has it already) plays ``category``."""
        storage = storage_of(t) if storage is None else storage
        if storage is None:
            return
        entry = self.existing(t, storage)
        with self._lock:
            if category in STICKY:
                entry.category = stronger(entry.category, category)
                self._special[entry.serial] = entry
                self.special_version += 1
            for listener in self._listeners:  # `_tell`, inline: marked at every module call
                if listener.device == entry.device:
                    try:
                        listener.on_mark(entry.serial, category)
                    except Exception as e:
                        self._failed(listener, e)

    def saved_by(self, t: torch.Tensor, packed: torch.Tensor) -> None:
        """Autograd saved ``t`` for backward as ``packed``; its storage stays saved until
        ``packed`` dies (when backward frees the graph, or the graph is dropped)."""
        storage = storage_of(t)
        if storage is None:
            return
        entry = self.existing(t, storage)
        ref = PackRef(packed, self._dead.append)
        ref.entry, ref.step = entry, 0
        with self._lock:
            self._packs[id(ref)] = ref
            entry.saved += 1
            self._special[entry.serial] = entry
            self.special_version += 1
            if entry.saved == 1:
                self._notify_saved(entry, True)

    def _unsaved(self, ref: PackRef) -> None:
        """Autograd let a saved alias go. Safe to run again after an interrupt."""
        entry = ref.entry
        if ref.step == 0:  # (no call between these lines: an interrupt cannot split them)
            ref.step = 1
            entry.saved -= 1
            self.special_version += 1
        if ref.step == 1:
            ref.step = 2
            if entry.saved == 0 and entry.alive:
                self._notify_saved(entry, False)
        self._packs.pop(id(ref), None)

    def _notify_saved(self, entry: Entry, saved: bool) -> None:
        self._tell(entry.device, "on_saved", entry.serial, saved)

    def _freed(self, ref: StorageRef) -> None:
        """One storage's free. Safe to run again after an interrupt: each step happens once."""
        entry = self._entries.get(ref.key)
        if entry is None or entry.ref is not ref:
            return
        if entry.alive:  # (no call between these lines: an interrupt cannot split them)
            entry.alive = False
            self._totals[entry.device] -= entry.nbytes
            self._when = time.perf_counter()  # one time for every listener
        listeners = self._listeners
        while entry.notified < len(listeners):
            listener = listeners[entry.notified]
            if listener.device == entry.device:  # told again if interrupted on its way in
                try:
                    listener.on_free(entry.serial, entry.nbytes, entry.category, self._when)
                except Exception as e:  # the others still hear of it (see `_tell`)
                    self._failed(listener, e)
            entry.notified += 1
        del self._entries[ref.key]
        self._resizing.pop(entry.serial, None)
        self._by_serial.pop(entry.serial, None)
        if self._special.pop(entry.serial, None) is not None:
            self.special_version += 1


_DEFAULT: Ledger | None = None


def default_ledger() -> Ledger:
    """The process's ledger, shared by every region, so that "allocated" on a CPU means the same
    thing from one region to the next: the live storages memlab has seen."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Ledger()
    return _DEFAULT
