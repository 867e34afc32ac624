"""A CUDA region's breakdown replayed when it is first read, not when the region closes.

Replaying the allocator's log (`memlab.core.cuda_settle.settle`) is the largest part of what a
breakdown costs at a region's end (about 1 ms for the log of a 20 ms training step on an H200,
more where Python runs slowly), and a report nobody reads does not need it: a quiet cell
(``%%gpumem -q -b`` keeps only the history's totals) or a region whose report is never opened.
`Later` keeps what the replay needs, plain numbers only (the log's events, the blocks alive at
the end, the addresses the hooks named: nothing of the user's), and replays it once, on first
use, from whichever thread asks first; the result is the same to the byte as a replay at the
end. A Ctrl-C during the replay leaves it to be done again at the next read.

What waits is bounded: logs of more than `PENDING_EVENTS` entries in all (events, blocks alive
at the end, names) are not kept waiting (the oldest are replayed when a new one comes), so a
program that keeps many reports never holds many logs; a report dropped unread lets its log go
with it. The replay's notes come after the region's other notes.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from memlab.core.categories import Category
from memlab.core.cuda_settle import settle
from memlab.core.recorder import Tally

#: Entries of the logs waiting for their replay, in all (events, blocks, names: a few hundred
#: bytes each at most): past it the oldest are replayed, and a larger log is replayed at once.
PENDING_EVENTS = 100_000
#: The categories a breakdown gives figures for (iterating an Enum is slow: once, here).
_NAMED = tuple(c for c in Category if c is not Category.UNATTRIBUTED)

_pending: deque[weakref.ref[Later]] = deque()
_pending_lock = threading.Lock()


class Later:
    """One region's replay, made on the first call (see the module's text). A call gives the
    tally (None where the log could not be replayed) and the notes the replay adds."""

    def __init__(
        self,
        events: Sequence[Mapping[str, Any]],
        before: int,
        blocks: Sequence[tuple[int, int]],
        named: Sequence[tuple[int, float | None, Category]],
        *,
        args: Sequence[tuple[int, float]],
        saved_before: Sequence[int],
        released: set[int],
        unsaved: Sequence[tuple[int, float, float]],
        complete: bool,
        limit: int,
    ) -> None:
        #: What it holds, in entries (events, blocks, names): what `PENDING_EVENTS` bounds.
        self.events = len(events) + len(blocks) + len(named) + len(args) + len(unsaved)
        self._inputs: tuple[Any, ...] | None = (
            events,
            before,
            blocks,
            named,
            dict(
                args=args,
                saved_before=saved_before,
                released=released,
                unsaved=unsaved,
                complete=complete,
            ),
            limit,
        )
        self._result: tuple[Tally | None, tuple[str, ...]] | None = None
        self._lock = threading.Lock()

    @property
    def made(self) -> bool:
        return self._result is not None

    def __call__(self) -> tuple[Tally | None, tuple[str, ...]]:
        with self._lock:  # (a second thread waits for the first's replay, and takes it)
            if self._result is None:
                assert self._inputs is not None
                self._result = _replay(*self._inputs)
                self._inputs = None  # (the log goes: only the figures stay)
            return self._result


def defer(later: Later) -> Later:
    """``later``, waiting for its first read; older logs replayed now where those waiting
    would hold more than `PENDING_EVENTS` entries (a log that large alone: replayed now)."""
    if later.events > PENDING_EVENTS:
        later()
        return later
    with _pending_lock:
        _pending.append(weakref.ref(later))
        waiting = [w for ref in _pending if (w := ref()) is not None and not w.made]
        _pending.clear()  # (the due ones stay listed until made: a Ctrl-C leaves them waiting)
        _pending.extend(weakref.ref(w) for w in waiting)
        total, due = sum(w.events for w in waiting), []
        for w in waiting:
            if total <= PENDING_EVENTS:
                break
            due.append(w)
            total -= w.events
    for d in due:  # (outside the lock: a replay may take a while)
        d()
    return later


def waiting() -> int:
    """How many logs wait for their replay (the tests read it)."""
    with _pending_lock:
        return sum(1 for ref in _pending if (w := ref()) is not None and not w.made)


def _replay(
    events: Sequence[Mapping[str, Any]],
    before: int,
    blocks: Sequence[tuple[int, int]],
    named: Sequence[tuple[int, float | None, Category]],
    options: dict[str, Any],
    limit: int,
) -> tuple[Tally | None, tuple[str, ...]]:
    try:
        s = settle(events, before, blocks, named, **options)
    except Exception as e:  # never the user's problem: the totals stand without it
        return None, (f"no breakdown: the allocator's log could not be settled ({e!r})",)
    notes: tuple[str, ...] = ()
    if not s.complete:
        notes = (
            f"the allocator's log holds only the region's last {len(events):,} events (it "
            f"keeps at most {limit:,}, or other code restarted it): the breakdown at the "
            "peak may miss what came before them",
        )

    def every(values: dict[Category, int]) -> dict[Category, int]:
        return {c: values.get(c, 0) for c in _NAMED}

    tally = Tally(
        before=before,
        after=s.end,
        peak=s.peak,
        at_peak=every(s.at_peak),
        at_end=every(s.at_end),
        highest=every(s.highest),
        times=None,
        totals=None,
        phases=None,
    )
    return tally, notes
