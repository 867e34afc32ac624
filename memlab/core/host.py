"""Host copies: the bytes an offload lever keeps in host memory, followed to their free.

An offloaded copy (an activation packed to the CPU by ``save_on_cpu``, the host-side optimizer's
state, master weights and gradients) is counted once per storage, under a kind ("activations",
"optimizer_state", "master_weights", "gradients"), until its owner dies: the storage's Python
object for a real tensor, or any object that stands for the copy (the estimator's packed
handles on ``meta``, which hold no memory). As in the ledger, the weak references' callbacks
only queue the dead key; the queue is settled before every question and every new copy, so the
running peak is exact.

The caching host allocator's own counters (pinned memory, CUDA builds) are read by
`host_allocator_stats` where torch has them.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memlab.core.storages import storage_of

#: The kinds of host copy, in the order reports show them.
KINDS = ("activations", "optimizer_state", "master_weights", "gradients")


@dataclass(frozen=True)
class HostFigures:
    """What the host copies added up to over a stretch (`HostCopies.begin` to `figures`)."""

    before: int
    after: int
    peak: int
    pinned_peak: int
    #: Bytes of each kind at the end, and the most each kind reached.
    at_end: dict[str, int]
    highest: dict[str, int]


class HostCopies:
    """Host copies by kind, with a running total and peak. Thread-safe (autograd packs on the
    forward's thread, but weak references die wherever the last reference goes)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        #: key -> (weak reference, kind, bytes, pinned)
        self._live: dict[int, tuple[weakref.ref[Any], str, int, bool]] = {}
        self._dead: deque[int] = deque()
        self._by_kind = dict.fromkeys(KINDS, 0)
        self._highest = dict.fromkeys(KINDS, 0)
        self.current = self.peak = self.pinned = self.pinned_peak = 0
        self._before = 0

    def add_tensor(self, t: torch.Tensor, kind: str, pinned: bool = False) -> None:
        """``t``'s storage, kept on the host as ``kind`` until it is freed."""
        storage = storage_of(t)
        if storage is not None:
            self.add(storage, kind, storage.nbytes(), pinned)

    def add(self, owner: object, kind: str, nbytes: int, pinned: bool = False) -> None:
        """``nbytes`` on the host as ``kind`` while ``owner`` lives (counted once per owner)."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of {', '.join(map(repr, KINDS))}.")
        with self._lock:
            self.settle()
            key = id(owner)
            if key in self._live:
                return
            # the callback holds the queue, not self: no reference cycle
            ref = weakref.ref(owner, _queue(self._dead, key))
            self._live[key] = (ref, kind, nbytes, pinned)
            self._by_kind[kind] += nbytes
            self._highest[kind] = max(self._highest[kind], self._by_kind[kind])
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            if pinned:
                self.pinned += nbytes
                self.pinned_peak = max(self.pinned_peak, self.pinned)

    def settle(self) -> None:
        """Take the frees queued since the last call."""
        with self._lock:
            while self._dead:
                key = self._dead.popleft()
                found = self._live.pop(key, None)
                if found is None:
                    continue
                _, kind, nbytes, pinned = found
                self._by_kind[kind] -= nbytes
                self.current -= nbytes
                if pinned:
                    self.pinned -= nbytes

    def begin(self) -> None:
        """Start a stretch: the peaks start again from what is on the host now."""
        with self._lock:
            self.settle()
            self._before = self.peak = self.current
            self.pinned_peak = self.pinned
            self._highest = dict(self._by_kind)

    def figures(self) -> HostFigures:
        with self._lock:
            self.settle()
            return HostFigures(
                before=self._before,
                after=self.current,
                peak=self.peak,
                pinned_peak=self.pinned_peak,
                at_end={k: v for k, v in self._by_kind.items() if v},
                highest={k: v for k, v in self._highest.items() if v},
            )


def _queue(dead: deque[int], key: int) -> Callable[[weakref.ref[Any]], None]:
    def died(_: weakref.ref[Any]) -> None:
        dead.append(key)

    return died


def host_allocator_stats() -> dict[str, int] | None:
    """The caching host allocator's counters (pinned memory) as ``{name: bytes or count}``:
    ``torch.cuda.host_memory_stats()`` where torch has it (2.7 and later) and CUDA is
    initialised; None elsewhere (a CPU build, or CUDA never used: nothing pinned through it)."""
    read = getattr(torch.cuda, "host_memory_stats", None)
    if read is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        stats = read()
    except RuntimeError:
        return None
    return {str(k): int(v) for k, v in stats.items() if isinstance(v, (int, float))}
