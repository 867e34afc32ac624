"""Following ``UntypedStorage.resize_``, which changes a storage's size outside the dispatcher.

FSDP (``fully_shard``) frees a unit's gathered parameters with ``untyped_storage().resize_(0)``
after its forward and refills them with ``resize_(n)`` before the next use; no dispatch mode sees
either. While a region is open, ``following_resizes`` wraps the public ``UntypedStorage.resize_``
so that each call reports the storage and its size before the call. The wrapper is installed once
for all the open regions (under the one lock of every torch patch memlab makes) and removed when
the last one closes; a listener's failure never fails the user's resize.

Why a wrapper rather than re-reading every live storage's size at each settle point: settling
happens at every op, and re-reading costs about 0.4 µs a live storage (measured on this
project's 2-core CPU box, torch 2.13: 2.0 ms for 5,000 storages), which at every op would dwarf
the accounting's ~30 µs; the wrapper adds about 5.6 µs to each ``resize_`` (0.7 µs bare), which
FSDP calls twice a parameter a step, and it stamps each resize when it happens, so the peak and
its phase are right. The re-reading is done once, when a region opens (`Ledger.resync`), for
the resizes made while no region was open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from memlab.core._torch import PATCH_LOCK
from memlab.core.storages import address_of

#: Called with the storage and its size in bytes before the resize.
ResizeListener = Callable[[torch.UntypedStorage, int], None]

_listeners: list[ResizeListener] = []
_saved: dict[str, Any] = {}
_MISSING = object()


#: The address of the storage being resized, before the call (while its listeners run).
before_ptr = 0


def _resize(self: torch.UntypedStorage, size: int) -> Any:
    global before_ptr
    before = self.nbytes()
    before_ptr = address_of(self)
    result = _saved["original"](self, size)
    for listener in tuple(_listeners):
        with contextlib.suppress(Exception):  # bookkeeping never breaks the user's resize
            listener(self, before)
    return result


def _install() -> None:
    cls = torch.UntypedStorage
    _saved["own"] = cls.__dict__.get("resize_", _MISSING)  # inherited from StorageBase as shipped
    _saved["original"] = cls.resize_
    cls.resize_ = _resize  # type: ignore[method-assign,assignment]


def _uninstall() -> None:
    cls = torch.UntypedStorage
    if cls.__dict__.get("resize_") is not _resize:
        return  # other code wrapped ours since: leave its wrapper (ours then passes through)
    own = _saved.pop("own")
    if own is _MISSING:
        del cls.resize_
    else:
        cls.resize_ = own  # type: ignore[method-assign]


class following_resizes:  # noqa: N801 (used as a context manager, as a function would be)
    """For the block, ``listener(storage, bytes_before)`` after every ``resize_`` of a storage
    called from Python (as FSDP calls it). (A class, not a generator: one per region.)"""

    __slots__ = ("_in", "_listener")

    def __init__(self, listener: ResizeListener) -> None:
        self._listener = listener
        self._in = False

    def __enter__(self) -> None:
        with PATCH_LOCK:
            if not _listeners:
                _install()
            _listeners.append(self._listener)
            self._in = True

    def __exit__(self, *exc: object) -> None:
        if not self._in:
            return
        self._in = False
        with PATCH_LOCK:
            _listeners.remove(self._listener)
            if not _listeners:
                _uninstall()


def installed() -> bool:
    """Whether the wrapper is in place now (tests check that it leaves)."""
    return torch.UntypedStorage.__dict__.get("resize_") is _resize
