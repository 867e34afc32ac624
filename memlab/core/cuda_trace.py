"""The CUDA caching allocator's event log of a region, read into blocks' lifetimes.

The allocator logs every block it hands out and takes back (``alloc`` and ``free_requested``,
with address, size and time) while its history is recorded (in C++: no Python per op).
`read_log` turns one device's log into blocks, each with its lifetime and its place in the log,
and `Log.at` finds the block an address held at a moment. `memlab.core.cuda_settle` gives the
blocks their roles and replays the log.

Sizes: the log gives each allocation's requested size (PyTorch 2.11); the block the allocator
handed out is that rounded up to 512 bytes, or more where it kept a large block whole. Blocks
alive at the end are read from the end's snapshot (`active_blocks`), exact.

A moment is placed by time: the log's ``time_us`` (Unix microseconds) against the hooks'
``time.time_ns() / 1000``. An address is handed out again only after it was freed, so the
lifetime that holds the moment is the one; where none does, the clocks may be a little apart
(``SLACK_US``): one begun just after the moment, else one ended just before it. Pure: a
recorded log reads the same on any machine.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import Any

#: How far apart the hooks' clock and the allocator's may be, in microseconds.
SLACK_US = 20
NEVER = float("-inf")
#: A role not given yet (roles are priorities: lower wins).
UNNAMED = 16

# A block is a list, for speed: [address, size, moment handed out (NEVER: before the region),
# moment freed or None, role, savings named, live in the replay, its place in the log (-1:
# before the region)].
ADDR, SIZE, START, END, ROLE, SAVES, LIVE, PLACE = range(8)


def rounded(size: int) -> int:
    """The smallest block the allocator hands out for ``size`` bytes."""
    return 512 if size < 512 else (size + 511) & ~511


class Log:
    """One device's log of a region, as blocks: ``order`` holds each block at its alloc and
    again at its free (``signs`` +1 / -1, ``times`` the moments); ``live`` the blocks handed out
    in the region alive at the end by address; ``older`` the blocks from before the region met
    so far (freed in it, or named: `at` makes one for an address alive from start to end when
    it is first asked about); ``kept`` the bytes by address of those from before alive at the
    end, met or not; ``exact`` the sizes the end's snapshot gives; ``missing`` the blocks the
    log holds alive that the allocator does not.

    A process holds many blocks from before a region that the region never touches (a model's
    weights, a cache): they are counted in bulk (``kept``), not one by one."""

    def __init__(self, events: Iterable[Mapping[str, Any]], active_at_end: Iterable[Any]) -> None:
        live: dict[int, list[Any]] = {}
        by_addr: dict[int, list[list[Any]]] = {}
        older: dict[int, list[Any]] = {}
        order: list[list[Any]] = []
        signs: list[int] = []
        times: list[float] = []
        add, sign, moment = order.append, signs.append, times.append
        for e in events:
            action = e["action"]
            if action == "alloc":
                addr, t, size = e["addr"], e["time_us"], e["size"]
                b = [addr, 512 if size < 512 else (size + 511) & ~511, t, None, UNNAMED, 0, 0,
                     len(order)]  # fmt: skip
                live[addr] = b
                mine = by_addr.get(addr)
                if mine is None:
                    by_addr[addr] = [b]
                else:
                    mine.append(b)
                add(b)
                sign(1)
                moment(t)
            elif action == "free_requested":
                addr, t = e["addr"], e["time_us"]
                found = live.pop(addr, None)
                if found is None:  # handed out before the region
                    found = [addr, rounded(e["size"]), NEVER, None, UNNAMED, 0, 1, -1]
                    older[addr] = found
                found[END] = t
                add(found)
                sign(-1)
                moment(t)
        self.freed_older = list(older.values())
        # (address -> size, in C: a process may hold many blocks; an address listed twice,
        # which no snapshot does, counts once, at its last size)
        kept = dict(active_at_end)
        self.exact: dict[int, int] = {a: kept.pop(a) for a in live if a in kept}
        self.missing = [b for a, b in live.items() if a not in self.exact]
        for b in self.missing:  # (freed by another thread between the log's read and the end's)
            del live[b[ADDR]]
        for addr in older.keys() & kept.keys():  # (an older block's address, handed out again
            del older[addr]  # and alive at the end: met as one alive throughout, as before)
        self.live, self.older, self.kept, self.order, self.signs, self.times = (
            live,
            older,
            kept,
            order,
            signs,
            times,
        )
        self._by_addr = by_addr
        self._starts: dict[int, list[float]] = {}

    def kept_block(self, addr: int) -> list[Any] | None:
        """The block from before alive at the end at ``addr``, made when first asked about."""
        size = self.kept.get(addr)
        if size is None:
            return None
        b = self.older.get(addr)
        if b is None or b[END] is not None:
            b = self.older[addr] = [addr, size, NEVER, None, UNNAMED, 0, 1, -1]
        return b

    def at(self, addr: int, when: float | None) -> list[Any] | None:
        """The block at ``addr`` alive at moment ``when`` (None: at the region's end)."""
        if when is None:
            found = self.live.get(addr)
            return found if found is not None else self.kept_block(addr)
        blocks = self._by_addr.get(addr)
        if blocks is not None:
            if len(blocks) == 1:
                b = blocks[0]  # (the usual case, as the bisection below would find it)
                end = b[END]
                if b[START] <= when:
                    return b if end is None or end >= when - SLACK_US else None
                if b[START] <= when + SLACK_US:
                    return b
            else:
                mine = self._starts.get(addr)
                if mine is None:
                    mine = self._starts[addr] = [b[START] for b in blocks]
                i = bisect.bisect_right(mine, when) - 1
                if i >= 0 and (blocks[i][END] is None or blocks[i][END] >= when):
                    return blocks[i]
                j = bisect.bisect_right(mine, when + SLACK_US) - 1
                if j > i:
                    return blocks[j]
                if i >= 0:
                    end = blocks[i][END]
                    return blocks[i] if end is not None and end >= when - SLACK_US else None
        old = self.older.get(addr)
        if old is not None and (old[END] is None or old[END] >= when - SLACK_US):
            return old
        return self.kept_block(addr) if old is None else None


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
