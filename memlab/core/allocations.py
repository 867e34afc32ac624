"""A region's CPU allocations as PyTorch's allocator reports them, read without a dispatch mode.

``AllocationRecord`` sees what tensor accounting cannot (buffers inside compiled code) at nearly
no cost per op; it knows sizes and addresses only, not what a block is for. Figures are relative
to the region's start: the highest the running total went above it, and where it ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

from memlab.core._torch_record import (
    allocation_record_available,
    start_allocation_record,
    stop_allocation_record,
)


@dataclass(frozen=True)
class Allocations:
    """What a recorded region allocated: ``events`` are (ns, bytes (negative: freed), address)."""

    events: tuple[tuple[int, int, int], ...]

    @property
    def peak(self) -> int:
        """The highest the bytes allocated went above the start (0 if never above)."""
        total = high = 0
        for _, size, _ in self.events:
            total += size
            high = max(high, total)
        return high

    @property
    def net(self) -> int:
        """Bytes allocated at the end minus at the start (negative where the region freed more)."""
        return sum(size for _, size, _ in self.events)

    @property
    def count(self) -> int:
        """How many allocations the region made (frees not counted)."""
        return sum(1 for _, size, _ in self.events if size > 0)


class AllocationRecord:
    """Context manager: ``with AllocationRecord() as rec: step()`` then ``rec.result``.

    One at a time per thread (it uses PyTorch's profiler; a running profiler makes it raise).
    """

    def __init__(self) -> None:
        self.result: Allocations | None = None
        self._on = False

    @staticmethod
    def available() -> str | None:
        """None where it works, else why not."""
        return allocation_record_available()

    def __enter__(self) -> AllocationRecord:
        start_allocation_record()
        self._on = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._on:
            self._on = False
            try:
                self.result = Allocations(tuple(stop_allocation_record()))
            except RuntimeError:
                if exc_type is None:  # never in place of the block's own exception
                    raise
