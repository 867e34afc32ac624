"""A breakdown from the CUDA caching allocator's own event log, settled once at a region's end.

The allocator logs every block it hands out and takes back (``alloc`` and ``free_requested``,
with address, size and time) while its history is recorded (in C++: no Python per op). Hooks
name some addresses at known moments (what autograd saves, each gradient before an optimizer
step), and the objects alive at the end name the rest (parameters, optimizer state, gradients).
`settle` gives each block the strongest role named within its lifetime and replays the log once,
from the allocator's own figure at the start.

Sizes: the log gives each allocation's requested size (PyTorch 2.11); the block the allocator
handed out is that rounded up to 512 bytes, or more where it kept a large block whole. Blocks
alive at the end are read from the end's snapshot, exact, so the end's figures are the
allocator's to the byte; at the peak, what a kept-whole remainder adds is left to the report's
"unattributed" (the allocator's own peak minus the categories).

A block from before the region that the region saved for backward is one of its inputs (what
the dispatch mode calls a storage from before that the region's ops read), unless a stronger
role names it (a parameter, a buffer).

A name is placed by time: the log's ``time_us`` (the allocator's clock in Unix microseconds)
against the hook's ``time.time_ns() / 1000``. A block at one address is handed out again only
after it was freed, so the lifetime that holds the moment is the one; where the two clocks
disagree by a few microseconds, the lifetime begun last (give or take ``SLACK_US``) is taken.

Pure: it reads lists and dicts, so a recorded log replays it on any machine.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from memlab.core.categories import PRIORITY, Category

#: How far apart the hook's clock and the allocator's may be, in microseconds.
SLACK_US = 20
_NEVER = float("-inf")
_RANK = [PRIORITY[c] for c in Category]
_BY_RANK = {PRIORITY[c]: c for c in Category}
_NONE = len(_RANK) + 1
_TEMPORARY, _OTHER = PRIORITY[Category.TEMPORARY], PRIORITY[Category.OTHER]
_ACTIVATION, _INPUT = PRIORITY[Category.ACTIVATION], PRIORITY[Category.INPUT]

# A block is a list, for speed: [address, size, moment handed out, moment freed or None, role]
# (role as a priority: lower wins; _NONE until named). A block from before the region has
# _NEVER as its start.
_ADDR, _SIZE, _START, _END, _ROLE = range(5)


@dataclasses.dataclass
class Settled:
    """The region's figures from the log."""

    before: int
    #: The replay's highest running total, and its end (the allocator's own at the end).
    peak: int
    end: int
    at_peak: dict[Category, int]
    at_end: dict[Category, int]
    highest: dict[Category, int]
    #: Names the hooks gave that fell in no block's lifetime (their bytes stay unnamed).
    unplaced: int
    #: Blocks handed out in the region.
    blocks: int


def rounded(size: int) -> int:
    """The smallest block the allocator hands out for ``size`` bytes."""
    return 512 if size < 512 else (size + 511) & ~511


def settle(
    events: Iterable[Mapping[str, Any]],
    before: int,
    active_at_end: Iterable[tuple[int, int]],
    named: Iterable[tuple[int, float | None, Category]],
) -> Settled:
    """The region's breakdown. ``events``: the allocator's log of the region, in order (one
    device's; actions other than ``alloc`` and ``free_requested`` are passed over);
    ``before``: the allocator's allocated bytes at the start; ``active_at_end``: (address,
    size) of every block allocated at the end (`active_blocks` of a snapshot); ``named``:
    (address, moment or None for the end, category) from the hooks and the end's objects."""
    live: dict[int, list[Any]] = {}
    by_addr: dict[int, list[list[Any]]] = {}
    starts: dict[int, list[float]] = {}
    older: dict[int, list[Any]] = {}
    order: list[list[Any]] = []  # each block at its alloc and again at its free
    signs: list[int] = []
    n = 0
    for e in events:
        action = e["action"]
        if action == "alloc":
            addr, t, size = e["addr"], e["time_us"], e["size"]
            b = [addr, 512 if size < 512 else (size + 511) & ~511, t, None, _NONE]
            live[addr] = b
            mine = by_addr.get(addr)
            if mine is None:
                by_addr[addr] = [b]
                starts[addr] = [t]
            else:
                mine.append(b)
                starts[addr].append(t)
            order.append(b)
            signs.append(1)
            n += 1
        elif action == "free_requested":
            addr = e["addr"]
            found = live.pop(addr, None)
            if found is None:  # handed out before the region
                found = older[addr] = [addr, rounded(e["size"]), _NEVER, None, _NONE]
            found[_END] = e["time_us"]
            b = found
            order.append(b)
            signs.append(-1)
    freed_older = list(older.values())
    exact: dict[int, int] = {}
    for addr, size in active_at_end:
        if addr in live:
            exact[addr] = size
        else:
            older[addr] = live[addr] = [addr, size, _NEVER, None, _NONE]
    # what the older blocks freed here held beyond their rounded sizes (a kept-whole block)
    known = sum(b[_SIZE] for b in older.values())
    if before > known and freed_older:
        max(freed_older, key=lambda b: b[_SIZE])[_SIZE] += before - known

    unplaced = 0
    for addr, when, category in named:
        at = _at(addr, when, live, by_addr, starts, older)
        if at is None:
            unplaced += 1
        elif PRIORITY[category] < at[_ROLE]:
            at[_ROLE] = PRIORITY[category]
    sums = [0] * (_NONE + 1)
    for b in older.values():
        if b[_ROLE] == _NONE:
            b[_ROLE] = _OTHER
        elif b[_ROLE] == _ACTIVATION:  # saved by the region, from before it: one of its inputs
            b[_ROLE] = _INPUT
        sums[b[_ROLE]] += b[_SIZE]
    if before > known and not freed_older:
        sums[_OTHER] += before - known
    total = peak = sum(sums)
    at_peak, highest = list(sums), list(sums)
    for b, sign in zip(order, signs, strict=True):
        r, size = b[_ROLE], b[_SIZE]
        if r == _NONE:
            r = b[_ROLE] = _TEMPORARY
        if sign > 0:
            total += size
            v = sums[r] = sums[r] + size
            if v > highest[r]:
                highest[r] = v
            if total > peak:
                peak = total
                at_peak = list(sums)
        else:
            total -= size
            sums[r] -= size
    at_end = [0] * (_NONE + 1)
    for addr, b in live.items():
        at_end[b[_ROLE] if b[_ROLE] != _NONE else _OTHER] += exact.get(addr, b[_SIZE])
    return Settled(
        before=before,
        peak=peak,
        end=sum(at_end),
        at_peak=_named(at_peak),
        at_end=_named(at_end),
        highest=_named(highest),
        unplaced=unplaced,
        blocks=n,
    )


def _named(values: Sequence[int]) -> dict[Category, int]:
    return {_BY_RANK[r]: v for r, v in enumerate(values) if r in _BY_RANK and v}


def _at(
    addr: int,
    when: float | None,
    live: dict[int, list[Any]],
    by_addr: dict[int, list[list[Any]]],
    starts: dict[int, list[float]],
    older: dict[int, list[Any]],
) -> list[Any] | None:
    """The block at ``addr`` alive at moment ``when`` (None: at the region's end)."""
    if when is None:
        return live.get(addr)
    mine = starts.get(addr)
    if mine is not None:
        i = bisect.bisect_right(mine, when + SLACK_US) - 1
        if i >= 0:  # the latest begun by then, unless it was over well before
            b = by_addr[addr][i]
            return b if b[_END] is None or b[_END] >= when - SLACK_US else None
    old = older.get(addr)
    if old is not None and (old[_END] is None or old[_END] >= when - SLACK_US):
        return old
    return None


def active_blocks(snapshot: Mapping[str, Any], device: int) -> list[tuple[int, int]]:
    """(address, size) of each allocated block on ``device`` in a snapshot's segments."""
    out = []
    for seg in snapshot.get("segments", ()):
        if seg.get("device", device) != device or seg.get("allocated_size") == 0:
            continue  # (another device's, or a segment the allocator holds only cached)
        addr = int(seg["address"])
        for blk in seg.get("blocks", ()):
            size = int(blk["size"])
            if blk.get("state") == "active_allocated":
                out.append((int(blk.get("address", addr)), size))
            addr += size
    return out
