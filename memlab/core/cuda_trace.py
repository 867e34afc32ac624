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

A block from before the region that it saved is one of its inputs, unless a stronger role
names it. A name is placed by time: the log's ``time_us`` (Unix microseconds) against the
hook's ``time.time_ns() / 1000``; an address is handed out again only after it was freed, so
the lifetime that holds the moment is the one (with ``SLACK_US`` for clocks a little apart).
An activation's role ends with its last saving; unnamed, a block is temporary where the region
freed it, else other. Pure: a recorded log replays it on any machine.
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

# A block is a list, for speed: [address, size, moment handed out, moment freed or None, role,
# savings named, live in the replay] (role as a priority: lower wins; _NONE until named). A
# block from before the region has _NEVER as its start.
_ADDR, _SIZE, _START, _END, _ROLE, _SAVES, _LIVE = range(7)


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
    #: Blocks the log holds alive at the end that the allocator does not: the log is not the
    #: region's whole (other code restarted the allocator's history inside it).
    missing: int = 0


def rounded(size: int) -> int:
    """The smallest block the allocator hands out for ``size`` bytes."""
    return 512 if size < 512 else (size + 511) & ~511


def settle(
    events: Iterable[Mapping[str, Any]],
    before: int,
    active_at_end: Iterable[tuple[int, int]],
    named: Iterable[tuple[int, float | None, Category]],
    *,
    args: Iterable[tuple[int, float]] = (),
    saved_before: Iterable[int] = (),
    unsaved: Iterable[tuple[int, float]] = (),
    complete: bool = True,
) -> Settled:
    """The region's breakdown. ``events``: the allocator's log of the region, in order (one
    device's; only ``alloc`` and ``free_requested`` are read); ``before``: the allocator's
    allocated bytes at the start; ``active_at_end``: (address, size) of each block allocated at
    the end (`active_blocks`); ``named``: (address, moment or None for the end, category).
    ``args``: (address, moment) of a module's arguments, inputs where from before the region;
    ``saved_before``: addresses a graph from before the region holds saved (activations until
    freed); ``unsaved``: (address, moment) where a saving named an activation ended (a block's
    role ends with its last); ``complete``: False where the log lost its first events."""
    live: dict[int, list[Any]] = {}
    by_addr: dict[int, list[list[Any]]] = {}
    starts: dict[int, list[float]] = {}
    older: dict[int, list[Any]] = {}
    order: list[list[Any]] = []  # each block at its alloc and again at its free
    signs: list[int] = []
    times: list[float] = []
    n = 0
    for e in events:
        action = e["action"]
        if action == "alloc":
            addr, t, size = e["addr"], e["time_us"], e["size"]
            b = [addr, 512 if size < 512 else (size + 511) & ~511, t, None, _NONE, 0, 0]
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
            times.append(t)
            n += 1
        elif action == "free_requested":
            addr, t = e["addr"], e["time_us"]
            found = live.pop(addr, None)
            if found is None:  # handed out before the region
                found = older[addr] = [addr, rounded(e["size"]), _NEVER, None, _NONE, 0, 1]
            found[_END] = t
            order.append(found)
            signs.append(-1)
            times.append(t)
    freed_older = list(older.values())
    exact: dict[int, int] = {}
    for addr, size in active_at_end:
        if addr in live:
            exact[addr] = size
        else:
            older[addr] = live[addr] = [addr, size, _NEVER, None, _NONE, 0, 1]
    missing = sum(1 for addr, b in live.items() if b[_START] != _NEVER and addr not in exact)
    # what the older blocks freed here held beyond their rounded sizes (a kept-whole block)
    known = sum(b[_SIZE] for b in older.values())
    extra = before - known if complete and before > known else 0
    if extra and freed_older:
        max(freed_older, key=lambda b: b[_SIZE])[_SIZE] += extra
        extra = 0

    unplaced = 0
    for addr, when, category in named:
        at = _at(addr, when, live, by_addr, starts, older)
        if at is None:
            unplaced += 1
            continue
        rank = PRIORITY[category]
        if rank == _ACTIVATION:
            at[_SAVES] += 1
        if rank < at[_ROLE]:
            at[_ROLE] = rank
    for addr, when in args:
        at = _at(addr, when, live, by_addr, starts, older)
        if at is not None and at[_START] == _NEVER and at[_ROLE] > _INPUT:
            at[_ROLE] = _INPUT
    kept = set()
    for addr in saved_before:
        at = older.get(addr)
        if at is not None:
            at[_ROLE] = min(at[_ROLE], _ACTIVATION)
            kept.add(addr)
    sums = [0] * (_NONE + 1)
    for b in older.values():
        if b[_ROLE] == _NONE:
            b[_ROLE] = _OTHER
        elif b[_ROLE] == _ACTIVATION and b[_ADDR] not in kept:
            b[_ROLE] = _INPUT  # saved by the region, from before it: one of its inputs
        sums[b[_ROLE]] += b[_SIZE]
    sums[_OTHER] += extra
    for b in order:  # unnamed: temporary where the region freed it, else other
        if b[_ROLE] == _NONE:
            b[_ROLE] = _TEMPORARY if b[_END] is not None else _OTHER
    ends = _ends(unsaved, live, by_addr, starts, older, times)

    total = peak = sum(sums)
    at_peak, highest = list(sums), list(sums)
    k = 0
    for i, (b, sign) in enumerate(zip(order, signs, strict=True)):
        while k < len(ends) and ends[k][0] <= i:  # savings over by now: the role ends
            k = _unsave(ends[k][1], sums, k)
        r, size = b[_ROLE], b[_SIZE]
        if sign > 0:
            b[_LIVE] = 1
            total += size
            v = sums[r] = sums[r] + size
            if v > highest[r]:
                highest[r] = v
            if total > peak:
                peak = total
                at_peak = list(sums)
        else:
            b[_LIVE] = 0
            total -= size
            sums[r] -= size
    while k < len(ends):
        k = _unsave(ends[k][1], sums, k)
    at_end = [0] * (_NONE + 1)
    for addr, b in live.items():
        at_end[b[_ROLE]] += exact.get(addr, b[_SIZE])
    return Settled(
        before=before,
        peak=peak,
        end=sum(at_end),
        at_peak=_named(at_peak),
        at_end=_named(at_end),
        highest=_named(highest),
        unplaced=unplaced,
        blocks=n,
        missing=missing,
    )


def _ends(
    unsaved: Iterable[tuple[int, float]],
    live: dict[int, list[Any]],
    by_addr: dict[int, list[list[Any]]],
    starts: dict[int, list[float]],
    older: dict[int, list[Any]],
    times: list[float],
) -> list[tuple[int, list[Any]]]:
    """(place in the replay, block) where the last saving of a block handed out in the region,
    named an activation, ended: from there it is what it would be unsaved."""
    last: dict[int, tuple[int, float, list[Any]]] = {}
    for addr, when in unsaved:
        b = _at(addr, when, live, by_addr, starts, older)
        if b is None or b[_START] == _NEVER or b[_ROLE] != _ACTIVATION:
            continue
        seen = last.get(id(b))
        count, latest = (seen[0], seen[1]) if seen is not None else (0, when)
        last[id(b)] = (count + 1, max(latest, when), b)
    out = [
        (bisect.bisect_right(times, when), b)
        for count, when, b in last.values()
        if count >= b[_SAVES]
    ]
    out.sort(key=lambda x: x[0])
    return out


def _unsave(b: list[Any], sums: list[int], k: int) -> int:
    """Ends ``b``'s saving in the replay (where it is live there) and returns ``k + 1``."""
    role = _TEMPORARY if b[_END] is not None else _OTHER
    if b[_LIVE] and b[_ROLE] == _ACTIVATION:
        sums[_ACTIVATION] -= b[_SIZE]
        sums[role] += b[_SIZE]
    b[_ROLE] = role
    return k + 1


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
    """The block at ``addr`` alive at moment ``when`` (None: at the region's end): the one whose
    lifetime holds it, else (the two clocks a few microseconds apart) one begun just after it
    or ended just before it."""
    if when is None:
        return live.get(addr)
    mine = starts.get(addr)
    i = -1
    if mine is not None:
        blocks = by_addr[addr]
        i = bisect.bisect_right(mine, when) - 1
        if i >= 0 and (blocks[i][_END] is None or blocks[i][_END] >= when):
            return blocks[i]
        j = bisect.bisect_right(mine, when + SLACK_US) - 1
        if j > i:
            return blocks[j]
        if i >= 0:
            end = blocks[i][_END]
            return blocks[i] if end is not None and end >= when - SLACK_US else None
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
