"""The ledger: every live tensor storage memlab has seen, followed to its free by a weak reference.

A storage is identified by its Python object, which PyTorch keeps alive exactly as long as the
storage itself (views share it), so a weak reference's callback fires when the memory is freed.
Entries hold weak references only: the ledger never keeps a tensor alive.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Protocol

import torch

from memlab.core.categories import STICKY, Category, stronger


class _Listener(Protocol):
    device: str

    def on_alloc(self, serial: int, delta: int, when: float) -> None: ...
    def on_free(self, serial: int, nbytes: int, category: Category | None) -> None: ...
    def on_discovered(self, serial: int, nbytes: int) -> None: ...
    def on_mark(self, serial: int, category: Category) -> None: ...
    def on_saved(self, serial: int, saved: bool) -> None: ...


class Entry:
    __slots__ = ("alive", "category", "device", "nbytes", "ref", "saved", "serial")

    def __init__(self, serial: int, ref: _StorageRef, nbytes: int, device: str) -> None:
        self.serial = serial
        self.ref = ref
        self.nbytes = nbytes
        self.category: Category | None = None
        self.device = device
        #: How many autograd nodes hold this storage saved for backward right now.
        self.saved = 0
        self.alive = True


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
        self._self_ref = weakref.ref(self)
        self._packs: dict[int, _PackRef] = {}

    # -- queries ----------------------------------------------------------------------------
    def total(self, device: str) -> int:
        return self._totals.get(device, 0)

    def next_serial(self) -> int:
        """Serials below this value belong to storages the ledger already knows."""
        with self._lock:
            serial = next(self._serials)
            return serial

    def entries(self, device: str) -> list[Entry]:
        with self._lock:
            return [e for e in self._entries.values() if e.device == device]

    def __len__(self) -> int:
        return len(self._entries)

    # -- listeners --------------------------------------------------------------------------
    def attach(self, listener: _Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def detach(self, listener: _Listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    # -- observations -----------------------------------------------------------------------
    def _add(self, storage: torch.UntypedStorage, nbytes: int, t: torch.Tensor) -> Entry:
        # The tensor's device, not the storage's: a fake CPU tensor's storage lives on "meta".
        device = device_key(t.device)
        key = id(storage)
        ref = _StorageRef(storage, _on_free)
        ref.key = key
        ref.ledger = self._self_ref
        entry = Entry(next(self._serials), ref, nbytes, device)
        self._entries[key] = entry
        self._totals[device] = self._totals.get(device, 0) + nbytes
        return entry

    def existing(self, t: torch.Tensor, storage: torch.UntypedStorage) -> Entry:
        """``t``'s storage, alive before now; registered as pre-existing if new to us."""
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
        ref = _PackRef(packed, _on_unpacked)
        ref.entry = entry
        ref.ledger = self._self_ref
        with self._lock:
            self._packs[id(ref)] = ref
            entry.saved += 1
            if entry.saved == 1:
                self._notify_saved(entry, True)

    def _unsaved(self, ref: _PackRef) -> None:
        with self._lock:
            if self._packs.pop(id(ref), None) is None:
                return
            entry = ref.entry
            entry.saved -= 1
            if entry.saved == 0 and entry.alive:
                self._notify_saved(entry, False)

    def _notify_saved(self, entry: Entry, saved: bool) -> None:
        for listener in self._listeners:
            if listener.device == entry.device:
                listener.on_saved(entry.serial, saved)

    def _freed(self, key: int, ref: _StorageRef) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.ref is not ref:
                return
            del self._entries[key]
            entry.alive = False
            self._totals[entry.device] -= entry.nbytes
            for listener in self._listeners:
                if listener.device == entry.device:
                    listener.on_free(entry.serial, entry.nbytes, entry.category)


class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a storage that knows its ledger key (and the ledger, weakly)."""

    __slots__ = ("key", "ledger")
    key: int
    ledger: weakref.ref[Ledger]


class _PackRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to the alias autograd holds for a saved tensor."""

    __slots__ = ("entry", "ledger")
    entry: Entry
    ledger: weakref.ref[Ledger]


def _on_unpacked(ref: _PackRef) -> None:
    ledger = ref.ledger()
    if ledger is not None:
        ledger._unsaved(ref)


def _on_free(ref: _StorageRef) -> None:
    ledger = ref.ledger()
    if ledger is not None:
        ledger._freed(ref.key, ref)


_DEFAULT: Ledger | None = None


def default_ledger() -> Ledger:
    """The process's ledger, shared by every region, so that "allocated" on a CPU means the same
    thing from one region to the next: the live storages memlab has seen."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Ledger()
    return _DEFAULT
