"""The bridge from tensor accounting to the allocator model: a ledger listener that replays
one device's allocations and frees, in order, through `CachingAllocator`."""

from __future__ import annotations

import time
from typing import Any

from memlab.core.categories import Category
from memlab.estimate.allocator import CachingAllocator, SimulatedOutOfMemoryError


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
        self.ended = 0.0
        self.sizes: dict[int, int] = {}

    def measuring(self, moment: str) -> None:
        """The step's ``on_measure``: where the measured step starts ("start") and ends."""
        if moment == "start":
            self.measured_from = len(self.trace)
            self.events_from = len(self.events)
        else:
            self.measured_to = len(self.trace)
            self.events_to = len(self.events)
            self.ended = time.perf_counter()

    def _note(self) -> None:
        s = self.allocator.stats
        self.trace.append((s.allocated, s.reserved))
        # stamped as the tensor accounting stamps its timeline: an allocation when its op
        # started, a free when it happens, never before the previous event
        self.stamps.append(
            max(self._when or time.perf_counter(), self.stamps[-1] if self.stamps else 0.0)
        )
        self._when = None

    def malloc(self, key: int, nbytes: int) -> None:
        if self.failed is not None:
            return
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
            self._freed(serial)
            self.malloc(serial, size + delta)
        elif delta > 0:
            self.malloc(serial, delta)
        self._when = None

    def on_free(self, serial: int, nbytes: int, category: Category | None, when: float) -> None:
        handle = self.handles.pop(serial, None)
        if handle is not None:
            self._when = when
            self.allocator.free(handle)
            self._freed(serial)
            self._note()

    def on_discovered(self, serial: int, nbytes: int) -> None:
        pass  # storages from before the estimate are not on the simulated GPU

    def on_mark(self, serial: int, category: Category) -> None:
        pass

    def on_saved(self, serial: int, saved: bool) -> None:
        pass
