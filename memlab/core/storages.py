"""What the ledger holds about one storage: its identity (the storage's Python object, followed
by a weak reference), its size, its role; and how a tensor's storage and device are found."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from memlab.core import fakes
from memlab.core.categories import Category


class Listener(Protocol):
    device: str

    def on_alloc(self, serial: int, delta: int, when: float) -> None: ...
    def on_free(self, serial: int, nbytes: int, category: Category | None, when: float) -> None: ...
    def on_discovered(self, serial: int, nbytes: int) -> None: ...
    def on_mark(self, serial: int, category: Category) -> None: ...
    def on_saved(self, serial: int, saved: bool) -> None: ...


class Entry:
    __slots__ = (
        "alive",
        "category",
        "device",
        "nbytes",
        "notified",
        "ptr",
        "ref",
        "saved",
        "serial",
    )

    def __init__(self, serial: int, ref: StorageRef, nbytes: int, device: str) -> None:
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
        #: The storage's address (0 if it has none): how the native record finds the free of
        #: a storage the ledger follows (`memlab.core.native.region`).
        self.ptr = 0
        if _ADDRESSES[0]:
            self.relocate()

    def relocate(self) -> None:
        """Reads the storage's address again (``resize_`` moves its memory)."""
        storage = self.ref()
        self.ptr = address_of(storage) if storage is not None else 0


#: Whether entries read their storage's address: only once the native record's allocator
#: wrapper is in (a block from before it has no place in its log, so its address is no use).
_ADDRESSES = [False]


def follow_addresses(entries: Iterable[Entry] = ()) -> None:
    """From now on, each new entry keeps its storage's address (`memlab.core.native`); the
    first call also reads it for ``entries`` (the ledger's, made before), so that the free of
    any storage the ledger follows can be placed or said."""
    if not _ADDRESSES[0]:
        _ADDRESSES[0] = True
        for entry in list(entries):
            entry.relocate()


def address_of(storage: torch.UntypedStorage) -> int:
    """A CPU storage's data address (the native record follows CPU blocks); 0 for any other
    storage (a fake tensor's warns when asked) and for one that cannot say."""
    try:
        return int(storage.data_ptr()) if storage.device.type == "cpu" else 0
    except Exception:
        return 0


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


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def wrapped_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a wrapper subclass holds (a DTensor: its local shard), by the tensor-subclass
    protocol's ``__tensor_flatten__`` (names of the inner tensors); [] for other tensors."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if not callable(flatten):
        return []
    names = flatten()[0]
    return [v for v in (getattr(t, n, None) for n in names) if isinstance(v, torch.Tensor)]


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage, or ``None`` for tensors without one (sparse, some subclasses). A
    wrapper subclass (a DTensor) answers for the first tensor it wraps (its local shard): the
    wrapper's own storage is a placeholder the size of the global tensor, with no memory."""
    if type(t) not in _PLAIN:
        try:
            inner = wrapped_tensors(t)
        except Exception:  # the subclass's own code raised: the tensor as it is
            inner = []
        if inner:
            t = inner[0]
        elif fakes.stale(t):  # a fake tensor left after its mode: it models nothing now
            return None
    try:
        return t.untyped_storage()
    except Exception:  # RuntimeError, NotImplementedError, a subclass's own error
        return None


#: The tensors that hold a sparse tensor's bytes, by layout. A COO tensor's by ``_indices`` and
#: ``_values``: they read a tensor not yet coalesced as it is (``indices()`` refuses one).
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors that hold a sparse tensor's bytes (its indices and values), which
    have the storages a sparse tensor itself has none of; [] for any other tensor. Asked only
    where `storage_of` found no storage, so a dense tensor's op pays nothing for it."""
    try:
        names = _SPARSE_PARTS.get(t.layout)
        if names is None:
            return []
        with torch.no_grad():  # reading the parts of a tensor that requires grad adds no node
            return [getattr(t, n)() for n in names]
    except Exception:  # a subclass's own layout or error: nothing to follow
        return []


class StorageRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a storage that knows its ledger key."""

    __slots__ = ("key",)
    key: int


class PackRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to the alias autograd holds for a saved tensor."""

    __slots__ = ("entry", "step")
    entry: Entry
    #: 0: saved; 1: counted down; 2: listeners told.
    step: int


def op_tensors(values: Any) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results: top level, and one level into lists and
    tuples (``cat``, ``stack``, ``split``). ATen schemas nest no deeper."""
    if isinstance(values, torch.Tensor):
        return [values]
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(w for w in v if isinstance(w, torch.Tensor))
    return found
