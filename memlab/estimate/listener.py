"""The bridge from tensor accounting to the allocator model: a ledger listener that replays
one device's allocations and frees, in order, through `CachingAllocator`; and, from the first
allocation whose size is chosen at run time (`memlab.estimate.spread`), through two more, with
each such allocation at its smallest and at its largest size."""

from __future__ import annotations

import copy
import time
from typing import Any

from memlab.core.categories import Category
from memlab.estimate.allocator import CachingAllocator, SimulatedOutOfMemoryError
from memlab.estimate.spread import Spread, claim


class AllocatorListener:
    """A ledger listener that replays one device's allocations through the allocator model."""

    def __init__(self, device: str, allocator: CachingAllocator, keep_events: bool) -> None:
        self.device = device
        self.keep_events = keep_events
        self.allocator = allocator
        self.handles: dict[int, int] = {}
        self.failed: str | None = None
        #: The allocator's (allocated, reserved) after every event, and where the measured step
        #: began in that list.
        self.trace: list[tuple[int, int]] = []
        self.measured_from: int | None = None
        self.measured_to: int | None = None
        #: With ``keep_events``: the allocation stream, in the format of a CUDA snapshot's
        #: ``device_traces`` (requested sizes; ``addr`` is the storage's serial), to compare
        #: with a real trace.
        self.events: list[dict[str, Any]] = []
        self.events_from = self.events_to = 0
        #: perf_counter time of each entry of ``trace``, and when the measured step ended.
        self.stamps: list[float] = []
        self._when: float | None = None
        self.started = self.ended = 0.0
        self.sizes: dict[int, int] = {}
        #: The allocations of a size chosen at run time, in order (`memlab.estimate.spread`).
        self.spreads: list[Spread] = []
        #: From the first of those: the stream replayed with each at its smallest, then its
        #: largest size; their handles; and their (allocated, reserved) beside ``trace``.
        self.sides: list[CachingAllocator] = []
        self.side_handles: list[dict[int, int]] = []
        self.side_failed = False
        self.side_trace: list[tuple[int, int, int, int]] = []

    def measuring(self, moment: str) -> None:
        """The step's ``on_measure``: where the measured step starts ("start"), when its region's
        clock starts ("opened": its timeline's zero) and where it ends ("end")."""
        if moment == "start":
            self.measured_from = len(self.trace)
            self.events_from = len(self.events)
        elif moment == "opened":  # the measured region's time zero
            self.started = time.perf_counter()
        else:
            self.measured_to = len(self.trace)
            self.events_to = len(self.events)
            self.ended = time.perf_counter()

    def _note(self) -> None:
        s = self.allocator.stats
        self.trace.append((s.allocated, s.reserved))
        if self.sides:
            low, high = (side.stats for side in self.sides)
            self.side_trace.append((low.allocated, low.reserved, high.allocated, high.reserved))
        else:
            self.side_trace.append((s.allocated, s.reserved, s.allocated, s.reserved))
        # stamped as the tensor accounting stamps its timeline: an allocation when its op
        # started, a free when it happens, never before the previous event
        self.stamps.append(
            max(self._when or time.perf_counter(), self.stamps[-1] if self.stamps else 0.0)
        )
        self._when = None

    def malloc(self, key: int, nbytes: int, spread: Spread | None = None) -> None:
        if self.failed is not None:
            return
        if spread is not None:
            self.spreads.append(spread)
            if not self.sides:  # from here on the three streams may part
                self.sides = [copy.deepcopy(self.allocator) for _ in range(2)]
                self.side_handles = [dict(self.handles), dict(self.handles)]
        sizes = (nbytes, nbytes) if spread is None else (spread.low, spread.high)
        for side, handles, size in zip(self.sides, self.side_handles, sizes, strict=False):
            if not self.side_failed:
                try:
                    handles[key] = side.malloc(size)
                except SimulatedOutOfMemoryError:
                    self.side_failed = True  # the range then says no more than the prediction
        try:
            self.handles[key] = self.allocator.malloc(nbytes)
        except SimulatedOutOfMemoryError as e:
            self.failed = str(e)
        if self.keep_events:
            self.events.append({"action": "alloc", "addr": key, "size": nbytes, "stream": 0})
            self.sizes[key] = nbytes
        self._note()

    def _freed(self, key: int) -> None:
        if self.keep_events:
            size = self.sizes.pop(key, 0)
            event = {"action": "free_completed", "addr": key, "size": size, "stream": 0}
            self.events.append(event)

    def on_alloc(self, serial: int, delta: int, when: float) -> None:
        self._when = when
        old = self.handles.pop(serial, None)
        if old is not None:  # a storage that grew: the allocator sees a new block
            size = self.allocator.block_size(old)
            self.allocator.free(old)
            self._side_free(serial)
            self._freed(serial)
            self.malloc(serial, size + delta)
        elif delta > 0:
            self.malloc(serial, delta, claim(delta))
        self._when = None

    def on_free(self, serial: int, nbytes: int, category: Category | None, when: float) -> None:
        handle = self.handles.pop(serial, None)
        if handle is not None:
            self._when = when
            self.allocator.free(handle)
            self._side_free(serial)
            self._freed(serial)
            self._note()

    def _side_free(self, key: int) -> None:
        for side, handles in zip(self.sides, self.side_handles, strict=True):
            handle = handles.pop(key, None)
            if handle is not None:
                side.free(handle)

    def on_discovered(self, serial: int, nbytes: int) -> None:
        pass  # storages from before the estimate are not on the simulated GPU

    def on_mark(self, serial: int, category: Category) -> None:
        pass

    def on_saved(self, serial: int, saved: bool) -> None:
        pass
