"""Fake tensors (``FakeTensorMode``'s): no memory, but while their mode is on they model a
device's, so the ledger counts them under the device they claim. Once the mode has ended they
model nothing: one left in a notebook is not registered (`memlab.core.storages.storage_of`), and
one registered while its mode was on is dropped at the next region's start (`Fakes.forget`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from memlab.core._torch import dispatch_mode_stack

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def mode_of(t: torch.Tensor) -> Any:
    """``t``'s fake mode, or None for any other tensor (a subclass's own attributes that raise,
    or a ``fake_mode`` of another kind, included)."""
    if type(t) in _PLAIN:
        return None
    try:
        mode = getattr(t, "fake_mode", None)
    except Exception:  # a subclass whose __getattr__ raises: not a fake tensor
        return None
    return mode if type(mode).__name__ == "FakeTensorMode" else None


def modes_on() -> set[int]:
    """The ids of the fake modes on the dispatch stack now."""
    try:
        return {id(m) for m in dispatch_mode_stack() if type(m).__name__ == "FakeTensorMode"}
    except Exception:  # a stack that cannot be read: every mode taken as on (counted)
        return set()


def stale(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor whose mode is not on (it models nothing now)."""
    mode = mode_of(t)
    return mode is not None and id(mode) not in modes_on()


class Fakes:
    """The ledger's fake entries: serial -> a weak reference to the entry's fake mode."""

    def __init__(self) -> None:
        self._modes: dict[int, weakref.ref[Any]] = {}

    def note(self, t: torch.Tensor, serial: int) -> None:
        """Registers ``serial`` as ``t``'s if ``t`` is a fake tensor (a plain one: one check)."""
        if type(t) not in _PLAIN:
            mode = mode_of(t)
            if mode is not None:
                self._modes[serial] = weakref.ref(mode)

    def forget(self, by_serial: dict[int, Any], freed: Callable[[Any], None]) -> None:
        """Each fake entry whose mode is no longer on, as freed (``freed(entry.ref)``)."""
        if not self._modes:
            return
        on = modes_on()
        for serial in [s for s, r in self._modes.items() if id(r()) not in on]:
            del self._modes[serial]
            entry = by_serial.get(serial)
            if entry is not None:
                freed(entry.ref)
