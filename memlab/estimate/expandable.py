"""The caching allocator with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.

What changes (c10/cuda/CUDACachingAllocator.cpp: ``find_expandable_block``,
``try_allocate_expandable_block``, ``map_block``, ``unmap_block``, ``should_split``; checked
against the source of torch 2.1 to 2.9, unchanged in these parts):

- each stream has one segment per pool (small, large): a range of virtual addresses (9/8 of the
  device's memory) in which physical pages are mapped as needed, 2 MiB pages for the small pool
  and 20 MiB pages for the large one;
- a request that no free mapped block fits maps pages at the lowest unmapped range of its
  segment that, with the free block just before it, has room: only the request's size less that
  free block, rounded up to whole pages, is mapped (``p.size()``, not the 20 MiB or 2 MiB
  ``alloc_size`` a new segment would take), and the free block grows into it;
- best fit counts a free block followed by unmapped space as large as it could grow, so any
  other free block that fits is taken first;
- a block is split whenever at least 512 B remain, in both pools (without expandable segments
  a large-pool block splits only when more than 1 MiB remains);
- ``empty_cache()`` (or the retry after a failed mapping) unmaps every page wholly inside a free
  block, wherever it lies: reserved memory can shrink in the middle of a segment.

So ``memory_allocated`` is unchanged but for the blocks no longer handed out whole (a large
block's remainder of 1 MiB or less is split off), and ``memory_reserved`` follows allocated
more closely: a freed block at the end of a segment is grown into rather than left beside a new
segment. Not modelled: a mapping that fails part way (the model checks the whole growth first),
``max_split_size``, other streams.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from memlab.estimate.allocator import (
    LARGE_BUFFER,
    MIN_BLOCK,
    SMALL_BUFFER,
    Block,
    CachingAllocator,
    SimulatedOutOfMemoryError,
)

#: The address space of one segment where the capacity is unlimited (only its size matters).
UNLIMITED_SPACE = 1 << 44


@dataclass(eq=False)
class Span(Block):
    """A block of an expandable segment: mapped (free or allocated, as a `Block`), or not."""

    mapped: bool = True


def page_size(small: bool) -> int:
    """The granularity pages are mapped in: 2 MiB (small pool), 20 MiB (large pool)."""
    return SMALL_BUFFER if small else LARGE_BUFFER


class ExpandableAllocator(CachingAllocator):
    """`CachingAllocator` with expandable segments (same interface: ``malloc``, ``free``,
    ``empty_cache``, ``stats``); ``stats.segments`` counts the expandable segments."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # per (small, stream): the unmapped spans, by address
        self._unmapped: dict[tuple[bool, int], list[Span]] = {}

    # -- the pieces of CachingAllocator that differ -----------------------------------------------
    def _take_free(self, rounded: int, small: bool, stream: int) -> Block | None:
        pool = self._pool(small, stream)
        i = bisect.bisect_left(pool, (rounded, -1), key=lambda e: e[:2])
        if i == len(pool):
            return None
        # best fit by the size a block could grow to: a block before unmapped space comes last
        while i + 1 < len(pool) and _growable(pool[i + 1][2]) < _growable(pool[i][2]):
            i += 1
        return pool.pop(i)[2]

    def _new_segment(self, rounded: int, small: bool, stream: int, at: int | None) -> Block:
        start, grow = self._room(rounded, small, stream)
        if self.capacity is not None and self.stats.reserved + grow > self.capacity:
            self.stats.alloc_retries += 1
            self.empty_cache()
            start, grow = self._room(rounded, small, stream)
            if self.stats.reserved + grow > self.capacity:
                self.stats.ooms += 1
                raise SimulatedOutOfMemoryError(
                    f"cannot map {grow:,} B more: {self.stats.reserved:,} B of "
                    f"{self.capacity:,} B are reserved, {self.stats.allocated:,} B allocated"
                )
        return self._grow(start, rounded)

    def _maybe_split(self, block: Block, rounded: int) -> Block:
        rest = block.size - rounded
        if rest >= MIN_BLOCK:  # in both pools
            tail = Span(
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

    def empty_cache(self) -> None:
        """Unmap every page wholly inside a free block."""
        for pool in list(self._free.values()):
            for _, _, b in list(pool):
                self._unmap(b)

    # -- expandable segments ---------------------------------------------------------------------
    def _space(self) -> int:
        if self.capacity is None:
            return UNLIMITED_SPACE
        return -(-(self.capacity + self.capacity // 8) // LARGE_BUFFER) * LARGE_BUFFER

    def _room(self, rounded: int, small: bool, stream: int) -> tuple[Span, int]:
        """Where the request goes (the lowest unmapped span, or the free block before it, with
        room enough), and how many bytes must be mapped for it."""
        for span in self._unmapped.get((small, stream), []):
            start: Span = span
            if _allocatable(span.prev):
                start = span.prev  # type: ignore[assignment]
            grow, have, b = 0, 0, start
            while b is not None and have < rounded and _allocatable(b):
                if b.mapped:
                    have += b.size
                else:
                    need = -(-(rounded - have) // page_size(small)) * page_size(small)
                    grow += min(need, b.size)
                    have += min(need, b.size)
                b = b.next  # type: ignore[assignment]
            if have >= rounded:
                return start, grow
        # a new segment: one unmapped span as long as its address space
        addr = self._next_addr
        self._next_addr += self._space() + LARGE_BUFFER
        span = Span(addr, self._space(), addr, small, stream, free=False, mapped=False)
        bisect.insort(self._unmapped.setdefault((small, stream), []), span, key=_addr)
        self.stats.segments += 1
        return self._room(rounded, small, stream)

    def _grow(self, start: Span, rounded: int) -> Span:
        """Map pages from ``start`` until one free block of at least ``rounded`` bytes is there;
        that block, out of the free lists."""
        block = start  # if mapped: free, still listed (merged below, and unlisted then)
        while not (block.mapped and block.size >= rounded):
            target = block if not block.mapped else block.next
            assert isinstance(target, Span) and not target.mapped
            have = block.size if block.mapped else 0
            page = page_size(block.small)
            self._map(target, min(-(-(rounded - have) // page) * page, target.size))
            block = target
            if block.prev is not None and _is_free_mapped(block.prev):  # merge what came before
                self._unlist(block.prev)
                block = self._join(block.prev, block)  # type: ignore[arg-type]
            nxt = block.next
            if isinstance(nxt, Span) and _is_free_mapped(nxt):
                self._unlist(nxt)
                block = self._join(block, nxt)
        return block

    def _map(self, span: Span, size: int) -> None:
        pool = self._unmapped[(span.small, span.stream)]
        pool.remove(span)
        if size < span.size:  # the rest stays unmapped
            rest = Span(
                span.addr + size,
                span.size - size,
                span.segment,
                span.small,
                span.stream,
                free=False,
                prev=span,
                next=span.next,
                mapped=False,
            )
            if span.next is not None:
                span.next.prev = rest
            span.next = rest
            span.size = size
            bisect.insort(pool, rest, key=_addr)
        span.mapped, span.free = True, True
        self.stats.reserved += size
        self.stats.peak_reserved = max(self.stats.peak_reserved, self.stats.reserved)

    def _unmap(self, b: Block) -> None:
        """Unmap the pages wholly inside the free block ``b`` (a `Span`)."""
        assert isinstance(b, Span)
        page = page_size(b.small)
        first = b.segment + -(-(b.addr - b.segment) // page) * page
        last = b.segment + (b.addr + b.size - b.segment) // page * page
        if last <= first:
            return
        self._unlist(b)
        before, after = first - b.addr, b.addr + b.size - last
        if before:
            head = Span(b.addr, before, b.segment, b.small, b.stream, prev=b.prev, next=b)
            if b.prev is not None:
                b.prev.next = head
            b.prev = head
            self._list(head)
        if after:
            tail = Span(last, after, b.segment, b.small, b.stream, prev=b, next=b.next)
            if b.next is not None:
                b.next.prev = tail
            b.next = tail
            self._list(tail)
        b.addr, b.size, b.mapped, b.free = first, last - first, False, False
        self.stats.reserved -= b.size
        pool = self._unmapped[(b.small, b.stream)]
        for neighbour in (b.prev, b.next):
            if isinstance(neighbour, Span) and not neighbour.mapped:
                pool.remove(neighbour)
                b = self._join(b, neighbour)
        bisect.insort(pool, b, key=_addr)

    def _join(self, a: Span, b: Span) -> Span:
        joined = self._merge(a, b)
        assert isinstance(joined, Span)
        return joined


def _addr(b: Block) -> int:
    return b.addr


def _allocatable(b: Block | None) -> bool:
    """Free, mapped or not (``allocatable`` in the C++)."""
    return isinstance(b, Span) and (b.free or not b.mapped)


def _is_free_mapped(b: Block) -> bool:
    return b.free and (not isinstance(b, Span) or b.mapped)


def _growable(b: Block) -> int:
    """``expandable_size``: a free block's size, plus the unmapped span after it."""
    nxt = b.next
    return b.size + (nxt.size if isinstance(nxt, Span) and not nxt.mapped else 0)


def replay_stream(
    events: Iterable[Mapping[str, Any]], allocator: CachingAllocator
) -> list[tuple[int, int]]:
    """An allocator trace's allocations and frees through ``allocator``: its (allocated,
    reserved) after each. The recorded allocator's own segment events are not replayed, but a
    run of ``segment_free`` events (``empty_cache()``, or an out-of-memory retry) empties the
    model's cache too."""
    handles: dict[int, int] = {}
    after: list[tuple[int, int]] = []
    releasing = False
    for e in events:
        action, addr = e.get("action"), int(e.get("addr", 0))
        if action == "segment_free":
            if not releasing:
                allocator.empty_cache()
            releasing = True
            continue
        releasing = False
        if action == "alloc":
            handles[addr] = allocator.malloc(int(e.get("size", 0)), int(e.get("stream", 0)))
        elif action in ("free_completed", "free_requested") and addr in handles:
            allocator.free(handles.pop(addr))
        else:
            continue
        after.append((allocator.stats.allocated, allocator.stats.reserved))
    return after
