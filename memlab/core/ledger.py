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
from typing import Protocol

import torch

from memlab.core.categories import STICKY, Category, stronger


class _Listener(Protocol):
    device: str

    def on_alloc(self, serial: int, delta: int, when: float) -> None: ...
    def on_free(self, serial: int, nbytes: int, category: Category | None, when: float) -> None: ...
    def on_discovered(self, serial: int, nbytes: int) -> None: ...
    def on_mark(self, serial: int, category: Category) -> None: ...
    def on_saved(self, serial: int, saved: bool) -> None: ...


class Entry:
    __slots__ = ("alive", "category", "device", "nbytes", "notified", "ref", "saved", "serial")

    def __init__(self, serial: int, ref: _StorageRef, nbytes: int, device: str) -> None:
        self.serial = serial
        self.ref = ref
        self.nbytes = nbytes
        self.category: Category | None = None
        self.device = device
        #: How many autograd nodes hold this storage saved for backward right now.
        self.saved = 0
        self.alive = True
        #: Listeners told of the free so far (settling resumes there after an interrupt).
        self.notified = 0


_DEVICE_KEYS: dict[torch.device, str] = {}


def device_key(device: torch.device) -> str:
    """``cuda`` becomes ``cuda:<current>``; other devices keep their string form."""
    key = _DEVICE_KEYS.get(device)
    if key is not None:
        return key
    index: int | None = device.index  # None for a bare "cuda" (torch's stubs say int)
    if device.type == "cuda" and index is None:
        return f"cuda:{torch.cuda.current_device()}"  # not cached: the current device can change
    key = _DEVICE_KEYS[device] = str(device)
    return key


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage, or ``None`` for tensors without one (sparse, some subclasses)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class Ledger:
    """Live storages by identity, with per-device byte totals.

    Thread-safe: autograd runs CUDA backward on its own threads, and weak-reference callbacks run
    wherever the last reference dies.
    """

    def __init__(self) -> None:
        self._entries: dict[int, Entry] = {}
        self._totals: dict[str, int] = {}
        self._listeners: list[_Listener] = []
        self._serials = itertools.count()
        self._lock = threading.RLock()
        self._packs: dict[int, _PackRef] = {}
        #: Dead references, in the order their storages (or saved aliases) died.
        self._dead: deque[weakref.ref[object]] = deque()
        self._when = 0.0
        #: Live entries by serial; those that ever had a role or were saved (reports sum the rest).
        self._by_serial: dict[int, Entry] = {}
        self._special: dict[int, Entry] = {}

    # -- queries ----------------------------------------------------------------------------
    def total(self, device: str) -> int:
        if self._dead:
            self.settle()
        return self._totals.get(device, 0)

    def next_serial(self) -> int:
        """Serials below this value belong to storages the ledger already knows."""
        with self._lock:
            self.settle()
            serial = next(self._serials)
            return serial

    def entries(self, device: str) -> list[Entry]:
        with self._lock:
            self.settle()
            return [e for e in self._entries.values() if e.device == device]

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
                    if type(ref) is _StorageRef:
                        self._freed(ref)
                    elif type(ref) is _PackRef:
                        self._unsaved(ref)
                    dead.popleft()
                except KeyboardInterrupt as e:  # settle all first: the figures stay right
                    interrupted = e
        if interrupted is not None:
            raise interrupted

    # -- listeners --------------------------------------------------------------------------
    def attach(self, listener: _Listener) -> None:
        with self._lock:
            self.settle()
            self._listeners.append(listener)

    def detach(self, listener: _Listener) -> None:
        with self._lock:
            self.settle()
            if listener in self._listeners:
                self._listeners.remove(listener)

    # -- observations -----------------------------------------------------------------------
    def _add(self, storage: torch.UntypedStorage, nbytes: int, t: torch.Tensor) -> Entry:
        # The tensor's device, not the storage's: a fake CPU tensor's storage lives on "meta".
        device = device_key(t.device)
        key = id(storage)
        ref = _StorageRef(storage, self._dead.append)
        ref.key = key
        entry = Entry(next(self._serials), ref, nbytes, device)
        self._entries[key] = entry
        self._by_serial[entry.serial] = entry
        self._totals[device] = self._totals.get(device, 0) + nbytes
        return entry

    def existing(self, t: torch.Tensor, storage: torch.UntypedStorage) -> Entry:
        """``t``'s storage, alive before now; registered as pre-existing if new to us."""
        if self._dead:  # first: a dead storage's id may be the new one's
            self.settle()
        key = id(storage)
        entry = self._entries.get(key)  # the common case, without the lock (atomic under the GIL)
        if entry is not None:
            return entry
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._add(storage, storage.nbytes(), t)
                for listener in self._listeners:
                    if listener.device == entry.device:
                        listener.on_discovered(entry.serial, entry.nbytes)
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
                entry = self._add(storage, nbytes, t)
                delta = nbytes
            else:
                delta = nbytes - entry.nbytes
                if delta == 0:
                    return entry
                entry.nbytes = nbytes
                self._totals[entry.device] += delta
            for listener in self._listeners:
                if listener.device == entry.device:
                    listener.on_alloc(entry.serial, delta, when)
            return entry

    def classify(self, t: torch.Tensor, category: Category) -> None:
        storage = storage_of(t)
        if storage is None:
            return
        entry = self.existing(t, storage)
        with self._lock:
            if category in STICKY:
                entry.category = stronger(entry.category, category)
                self._special[entry.serial] = entry
            for listener in self._listeners:
                if listener.device == entry.device:
                    listener.on_mark(entry.serial, category)

    def saved_by(self, t: torch.Tensor, packed: torch.Tensor) -> None:
        """Autograd saved ``t`` for backward as ``packed``; its storage stays saved until
        ``packed`` dies (when backward frees the graph, or the graph is dropped)."""
        storage = storage_of(t)
        if storage is None:
            return
        entry = self.existing(t, storage)
        ref = _PackRef(packed, self._dead.append)
        ref.entry = entry
        ref.step = 0
        with self._lock:
            self._packs[id(ref)] = ref
            entry.saved += 1
            self._special[entry.serial] = entry
            if entry.saved == 1:
                self._notify_saved(entry, True)

    def _unsaved(self, ref: _PackRef) -> None:
        """Autograd let a saved alias go. Safe to run again after an interrupt."""
        entry = ref.entry
        if ref.step == 0:  # (no call between these lines: an interrupt cannot split them)
            ref.step = 1
            entry.saved -= 1
        if ref.step == 1:
            ref.step = 2
            if entry.saved == 0 and entry.alive:
                self._notify_saved(entry, False)
        self._packs.pop(id(ref), None)

    def _notify_saved(self, entry: Entry, saved: bool) -> None:
        for listener in self._listeners:
            if listener.device == entry.device:
                listener.on_saved(entry.serial, saved)

    def _freed(self, ref: _StorageRef) -> None:
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
                listener.on_free(entry.serial, entry.nbytes, entry.category, self._when)
            entry.notified += 1
        del self._entries[ref.key]
        self._by_serial.pop(entry.serial, None)
        self._special.pop(entry.serial, None)


class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a storage that knows its ledger key."""

    __slots__ = ("key",)
    key: int


class _PackRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to the alias autograd holds for a saved tensor."""

    __slots__ = ("entry", "step")
    entry: Entry
    #: 0: saved; 1: counted down; 2: listeners told.
    step: int


_DEFAULT: Ledger | None = None


def default_ledger() -> Ledger:
    """The process's ledger, shared by every region, so that "allocated" on a CPU means the same
    thing from one region to the next: the live storages memlab has seen."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Ledger()
    return _DEFAULT
