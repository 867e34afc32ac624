"""A model of PyTorch's CUDA caching allocator, to replay an allocation stream without a GPU.

The rules (c10/cuda/CUDACachingAllocator.cpp, default settings):
- a request is rounded up to a multiple of 512 B (at least 512 B);
- requests up to 1 MiB come from the small pool, others from the large pool;
- a new segment (cudaMalloc) is 2 MiB for the small pool, 20 MiB for large requests under
  10 MiB, and the request rounded up to 2 MiB otherwise;
- a request takes the smallest cached free block of its pool and stream that fits (ties: the
  lowest address), else a new segment; without the driver's addresses, a new segment lies
  below the others (the driver's order in the validation runs' traces, tests/data/validation);
- the block is split when the rest is at least 512 B (small pool) or more than 1 MiB (large
  pool); otherwise the whole block is handed out and counted as allocated;
- a freed block merges with free neighbours of its segment; whole free segments go back to the
  driver only on empty_cache() or when a new segment would not fit (then the allocation is
  retried once: a "retry"; if it still does not fit: out of memory).

Not modelled here: expandable segments (`memlab.estimate.expandable` models them),
max_split_size and roundup_power2_divisions settings, cross-stream frees (record_stream), graph
pools.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Any

KiB, MiB = 1024, 1024**2
MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB
SMALL_BUFFER = 2 * MiB
MIN_LARGE_ALLOC = 10 * MiB
LARGE_BUFFER = 20 * MiB
ROUND_LARGE = 2 * MiB


class SimulatedOutOfMemoryError(MemoryError):
    """The request does not fit in the simulated device's capacity."""


def round_size(n: int) -> int:
    return MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK


def segment_size(rounded: int) -> int:
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class Block:
    addr: int
    size: int
    segment: int  # the segment's base address
    small: bool
    stream: int
    free: bool = True
    prev: Block | None = None
    next: Block | None = None

    def key(self) -> tuple[int, int]:
        return (self.size, self.addr)


@dataclass
class Stats:
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    alloc_retries: int = 0
    ooms: int = 0
    segments: int = 0


@dataclass
class CachingAllocator:
    """``malloc(size, stream)`` returns a handle; ``free(handle)``; ``stats``; ``empty_cache()``.
    ``capacity``: the device memory available to segments (``None``: unlimited)."""

    capacity: int | None = None
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self) -> None:
        self._free: dict[tuple[bool, int], list[tuple[int, int, Block]]] = {}
        self._live: dict[int, Block] = {}
        self._handles = itertools.count(1)
        self._next_addr = 1 << 48  # segments get decreasing addresses, never reused

    # -- the public operations ------------------------------------------------------------------
    def malloc(self, size: int, stream: int = 0, segment_at: int | None = None) -> int:
        """``segment_at``: where the driver put the segment, if this request needs a new one (a
        replayed trace knows it). Ties between equal free blocks go to the lowest address, so
        where segments lie decides which of them a later request takes."""
        rounded = round_size(size)
        small = rounded <= SMALL_SIZE
        block = self._take_free(rounded, small, stream)
        if block is None:
            block = self._new_segment(rounded, small, stream, segment_at)
        block = self._maybe_split(block, rounded)
        block.free = False
        handle = next(self._handles)
        self._live[handle] = block
        self.stats.allocated += block.size
        self.stats.peak_allocated = max(self.stats.peak_allocated, self.stats.allocated)
        return handle

    def free(self, handle: int) -> None:
        block = self._live.pop(handle)
        self.stats.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._unlist(neighbour)
                block = self._merge(block, neighbour)
        self._list(block)

    def empty_cache(self) -> None:
        """Give every wholly free segment back to the driver."""
        for pool in self._free.values():
            for _, _, b in list(pool):
                if b.prev is None and b.next is None:
                    self._release(b)

    def segments(self) -> list[dict[str, Any]]:
        """The cache now, in the format of ``torch.cuda.memory_snapshot()``'s segments: each
        with its ``address``, ``total_size`` and ``blocks`` (``size``, ``state``) in address
        order."""
        blocks = [b for pool in self._free.values() for _, _, b in pool]
        blocks += self._live.values()
        by_segment: dict[int, list[Block]] = {}
        for b in blocks:
            by_segment.setdefault(b.segment, []).append(b)
        return [
            {
                "address": base,
                "total_size": sum(b.size for b in members),
                "stream": members[0].stream,
                "segment_type": "small" if members[0].small else "large",
                "blocks": [
                    {"size": b.size, "state": "inactive" if b.free else "active_allocated"}
                    for b in sorted(members, key=lambda b: b.addr)
                ],
            }
            for base, members in sorted(by_segment.items())
        ]

    def block_size(self, handle: int) -> int:
        """What ``memory_allocated`` counts for this allocation (may exceed the request)."""
        return self._live[handle].size

    # -- internals -----------------------------------------------------------------------------
    def _pool(self, small: bool, stream: int) -> list[tuple[int, int, Block]]:
        return self._free.setdefault((small, stream), [])

    def _list(self, b: Block) -> None:
        bisect.insort(self._pool(b.small, b.stream), (b.size, b.addr, b), key=lambda e: e[:2])

    def _unlist(self, b: Block) -> None:
        pool = self._pool(b.small, b.stream)
        i = bisect.bisect_left(pool, b.key(), key=lambda e: e[:2])
        assert pool[i][2] is b
        pool.pop(i)

    def _take_free(self, rounded: int, small: bool, stream: int) -> Block | None:
        pool = self._pool(small, stream)
        i = bisect.bisect_left(pool, (rounded, -1), key=lambda e: e[:2])
        if i == len(pool):
            return None
        return pool.pop(i)[2]

    def _new_segment(self, rounded: int, small: bool, stream: int, at: int | None) -> Block:
        size = segment_size(rounded)
        if self.capacity is not None and self.stats.reserved + size > self.capacity:
            self.stats.alloc_retries += 1
            self.empty_cache()
            if self.stats.reserved + size > self.capacity:
                self.stats.ooms += 1
                raise SimulatedOutOfMemoryError(
                    f"cannot reserve {size:,} B more: {self.stats.reserved:,} B of "
                    f"{self.capacity:,} B are reserved, {self.stats.allocated:,} B allocated"
                )
        # without the driver's address: below every segment so far, with a gap (never
        # contiguous), as the driver handed them out in the recorded traces (top down)
        addr = self._next_addr - size - ROUND_LARGE if at is None else at
        self._next_addr = min(self._next_addr, addr)
        self.stats.reserved += size
        self.stats.segments += 1
        self.stats.peak_reserved = max(self.stats.peak_reserved, self.stats.reserved)
        return Block(addr, size, addr, small, stream)

    def _maybe_split(self, block: Block, rounded: int) -> Block:
        rest = block.size - rounded
        if rest >= MIN_BLOCK if block.small else rest > SMALL_SIZE:
            tail = Block(
                block.addr + rounded,
                rest,
                block.segment,
                block.small,
                block.stream,
                prev=block,
                next=block.next,
            )
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = rounded
            self._list(tail)
        return block

    def _merge(self, a: Block, b: Block) -> Block:
        first, second = (a, b) if a.addr < b.addr else (b, a)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

    def _release(self, b: Block) -> None:
        self._unlist(b)
        self.stats.reserved -= b.size
        self.stats.segments -= 1
