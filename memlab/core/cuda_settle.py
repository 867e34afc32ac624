"""A region's breakdown from the CUDA allocator's log (`memlab.core.cuda_trace`), settled once
at its end: each block takes the strongest role named within its lifetime, and the log is
replayed once from the allocator's own figure at the start.

The roles follow the dispatch mode's rules (`memlab.core.recorder`): a block is an activation
while autograd holds it saved (its role ends with its last saving, at that moment in the
replay; a graph from before the region counts until backward frees or releases it); a block
from before the region that the region saved, or gave a module at the top, is an input; one
never named is temporary where the region freed it, else other. At the end the figures are
the allocator's blocks to the byte; at the peak, a large block's kept-whole remainder is left
to the report's "unattributed". A log that lost its first events (the allocator keeps a
bounded number, or other code restarted its history) is replayed from what it holds: names
from before its first event are dropped, and ``Settled.complete`` says so.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any

from memlab.core.categories import PRIORITY, Category
from memlab.core.cuda_trace import END, LIVE, NEVER, PLACE, ROLE, SAVES, SIZE, SLACK_US, START, Log
from memlab.core.cuda_trace import UNNAMED as _NONE

_BY_RANK = {PRIORITY[c]: c for c in Category}
_TEMPORARY, _OTHER = PRIORITY[Category.TEMPORARY], PRIORITY[Category.OTHER]
_ACTIVATION, _INPUT = PRIORITY[Category.ACTIVATION], PRIORITY[Category.INPUT]


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
    #: Whether the log held the whole region (see the module's text).
    complete: bool = True


def settle(
    events: Iterable[Mapping[str, Any]],
    before: int,
    active_at_end: Iterable[tuple[int, int]],
    named: Iterable[tuple[int, float | None, Category]],
    *,
    args: Iterable[tuple[int, float]] = (),
    saved_before: Iterable[int] = (),
    released: Collection[int] = (),
    unsaved: Iterable[tuple[int, float, float]] = (),
    complete: bool = True,
) -> Settled:
    """``events``: one device's log of the region, in order; ``before``: the allocator's
    allocated bytes at the start; ``active_at_end``: (address, size) of each block allocated
    at the end; ``named``: (address, moment or None for the end, category). ``args``: (address,
    moment) of a module's arguments; ``saved_before``: addresses a graph from before the
    region held saved at its start, ``released`` those of them no longer saved at its end;
    ``unsaved``: (address, moment saved, moment the saving ended); ``complete``: False where
    the allocator said it dropped the log's first events."""
    log = Log(events, active_at_end)
    older, order, signs = log.older, log.order, log.signs
    kept_bytes = sum(log.kept.values())  # (the blocks from before alive at the end, in bulk)
    known = kept_bytes + sum(b[SIZE] for b in older.values())
    complete = complete and known <= before  # (more from before than there was: a cut log)
    extra = before - known if complete and before > known else 0
    if extra and log.freed_older:  # what a kept-whole block from before held beyond its request
        max(log.freed_older, key=lambda b: b[SIZE])[SIZE] += extra
        extra = 0
    cutoff = NEVER if complete or not log.times else log.times[0] - SLACK_US

    unplaced = 0
    at, at_end_of, kept_block = log.at, log.live.get, log.kept_block
    for addr, when, category in named:
        if when is None:  # (most names are the end's: found without the moment's search)
            found = at_end_of(addr) or kept_block(addr)
        elif when < cutoff:
            continue
        else:
            found = at(addr, when)
        if found is None:
            unplaced += 1
            continue
        rank = PRIORITY[category]
        if rank == _ACTIVATION:
            found[SAVES] += 1
        if rank < found[ROLE]:
            found[ROLE] = rank
    for addr, when in args:
        found = at(addr, when) if when >= cutoff else None
        if found is not None and found[START] == NEVER and found[ROLE] > _INPUT:
            found[ROLE] = _INPUT
    held: dict[int, list[Any]] = {}  # saved by a graph from before, and still from before
    if complete:
        for addr in saved_before:
            b = older.get(addr) or log.kept_block(addr)
            if b is not None:
                held[addr] = b
    for b in held.values():
        b[ROLE] = min(b[ROLE], _ACTIVATION)
    sums = [0] * (_NONE + 1)
    met_kept = 0  # (the bytes of blocks alive throughout that a name or a saving met)
    met = list(older.values())  # (a saving's end looked up below may meet more: counted in bulk)
    for b in met:
        if b[ROLE] == _NONE:
            b[ROLE] = _OTHER
        elif b[ROLE] == _ACTIVATION and b[0] not in held and complete:
            b[ROLE] = _INPUT  # saved by the region, from before it: one of its inputs
        sums[b[ROLE]] += b[SIZE]
        if b[END] is None:
            met_kept += b[SIZE]
    sums[_OTHER] += extra + kept_bytes - met_kept
    for b in order:
        if b[ROLE] == _NONE:
            b[ROLE] = _TEMPORARY if b[END] is not None else _OTHER
    ends = _ends(log, unsaved, cutoff)
    ends += [(len(order), b) for a, b in held.items() if a in released and b[END] is None]

    # the peak, from the running total alone (in C); then the roles' sums, replayed once
    deltas = [b[SIZE] if s > 0 else -b[SIZE] for b, s in zip(order, signs, strict=True)]
    totals = list(accumulate(deltas, initial=sum(sums)))
    peak = max(totals)
    at_peak_after = totals.index(peak) - 1  # (the event that first reached it; -1: the start)
    at_peak = list(sums)
    highest = list(sums)
    n, k, m = len(order), 0, len(ends)
    due = ends[0][0] if ends else n
    for i, b in enumerate(order):
        if i >= due:  # savings over by now: the role ends
            while k < m and ends[k][0] <= i:
                _unsave(ends[k][1], sums, highest)
                k += 1
            due = ends[k][0] if k < m else n
        r, size = b[ROLE], b[SIZE]
        if signs[i] > 0:
            b[LIVE] = 1
            v = sums[r] = sums[r] + size
            if v > highest[r]:
                highest[r] = v
        else:
            b[LIVE] = 0
            sums[r] -= size
        if i == at_peak_after:
            at_peak = list(sums)
    for _, b in ends[k:]:
        _unsave(b, sums, highest)
    at_end = [0] * (_NONE + 1)
    exact = log.exact
    for addr, b in log.live.items():
        at_end[b[ROLE]] += exact[addr]
    for b in met:
        if b[END] is None:
            at_end[b[ROLE]] += b[SIZE]
    at_end[_OTHER] += kept_bytes - met_kept
    return Settled(
        before=before,
        peak=peak,
        end=sum(at_end),
        at_peak=_named(at_peak),
        at_end=_named(at_end),
        highest=_named(highest),
        unplaced=unplaced,
        blocks=signs.count(1),
        complete=complete,
    )


def _ends(
    log: Log, unsaved: Iterable[tuple[int, float, float]], cutoff: float
) -> list[tuple[int, list[Any]]]:
    """(place in the replay, block) where the last saving of a block handed out in the region,
    named an activation, ended: from there it is what it would be unsaved. Each saving's block
    is the one its start named (an address can be handed out again before the end is told)."""
    last: dict[int, tuple[int, float, list[Any]]] = {}
    for addr, saved_at, ended_at in unsaved:
        if saved_at < cutoff:
            continue
        b = log.at(addr, saved_at)
        if b is None or b[START] == NEVER or b[ROLE] != _ACTIVATION:
            continue
        seen = last.get(id(b))
        count, latest = (seen[0], seen[1]) if seen is not None else (0, ended_at)
        last[id(b)] = (count + 1, max(latest, ended_at), b)
    out = [
        (max(bisect.bisect_right(log.times, when), b[PLACE] + 1), b)
        for count, when, b in last.values()
        if count >= b[SAVES]
    ]
    out.sort(key=lambda x: x[0])
    return out


def _unsave(b: list[Any], sums: list[int], highest: list[int]) -> None:
    """Ends ``b``'s saving in the replay: from here an activation is temporary where the region
    frees it, else other."""
    if b[ROLE] != _ACTIVATION:
        return  # (a parameter a graph from before saved stays a parameter)
    role = _TEMPORARY if b[END] is not None and b[START] != NEVER else _OTHER
    if b[LIVE]:
        sums[_ACTIVATION] -= b[SIZE]
        v = sums[role] = sums[role] + b[SIZE]
        highest[role] = max(highest[role], v)
    b[ROLE] = role


def _named(values: Sequence[int]) -> dict[Category, int]:
    return {_BY_RANK[r]: v for r, v in enumerate(values) if r in _BY_RANK and v}
