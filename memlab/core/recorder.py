"""The recorder: one region's allocations and frees on one device, and what they add up to.

The recorder keeps a running total and peak. When a breakdown or a timeline is asked for it also
keeps the event stream (compact arrays, ~26 bytes an event) and replays it at the end, once every
storage's role is known: a gradient buffer is born as a backward temporary and only later becomes
``param.grad``, so categories at the peak can only be exact after the fact.

Roles: a storage's lasting role (parameter, buffer, optimizer state, gradient, input) holds for
the whole region. Otherwise it is an activation while autograd holds it saved for backward, and
outside those times: a temporary if the region created and freed it, an input if it predates the
region and the region read it, else "other".
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Collection
from dataclasses import dataclass

from memlab.core.categories import Category, stronger
from memlab.core.ledger import Ledger


class Phase:
    """Codes for what the program was doing when an event happened. A front end may label a
    stretch of the region itself (`memlab.track.phase`): a generation's prompt read at once
    ("prefill") and its tokens made one at a time ("decode")."""

    OTHER, FORWARD, BACKWARD, OPTIMIZER, PREFILL, DECODE = 0, 1, 2, 3, 4, 5
    NAMES = ("other", "forward", "backward", "optimizer", "prefill", "decode")


_BYTES, _SAVED, _UNSAVED = 0, 1, 2


@dataclass
class Tally:
    """What a recorder's events add up to. (Not frozen: a frozen dataclass is made field by
    field through ``object.__setattr__``, and one is made at every region's end.)"""

    before: int
    after: int
    peak: int
    at_peak: dict[Category, int] | None
    at_end: dict[Category, int] | None
    highest: dict[Category, int] | None
    times: array[float] | None
    totals: array[int] | None
    phases: array[int] | None
    #: Where the categories are made when first read (`memlab.core.cuda_later`): gives the
    #: tally with them (None where none could be made) and the notes the making adds.
    later: Callable[[], tuple[Tally | None, tuple[str, ...]]] | None = None


class Recorder:
    """Listens to a ledger for one device between ``start()`` and ``stop()``."""

    def __init__(
        self,
        ledger: Ledger,
        device: str,
        keep_events: bool,
        phase: Callable[[], int],
        since: int = 0,
    ) -> None:
        self.ledger = ledger
        self.device = device
        self.keep_events = keep_events
        self._phase = phase
        #: Storages with a serial below it that the region never touches are left out of every
        #: figure (`memlab.track`'s ``since``).
        self.since = since
        self.before = self.current = self.peak = 0
        self._t0 = 0.0
        self._last = 0.0
        self._first_serial = 0
        self._serials: array[int] = array("q")
        self._deltas: array[int] = array("q")
        self._kinds: array[int] = array("b")
        self._times: array[float] = array("d")
        self._phases: array[int] = array("b")
        self._discovered: dict[int, int] = {}
        self._freed_role: dict[int, Category | None] = {}
        self._marks: dict[int, Category] = {}

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        with self.ledger._lock:
            self._first_serial = self.ledger.next_serial()
            self.before = self.current = self.peak = self.ledger.total(self.device)
            self._t0 = time.perf_counter()
            self.ledger.attach(self)

    def set_origin(self, t0: float) -> None:
        """Time zero of the region (perf_counter); events before it are stamped 0."""
        self._t0 = t0

    def stop(self) -> None:
        self.ledger.detach(self)

    def _predates(self, serial: int) -> bool:
        return serial < self._first_serial or serial in self._discovered

    # -- ledger callbacks (called under the ledger's lock) ------------------------------------
    def _log(self, serial: int, delta: int, kind: int, when: float | None = None) -> None:
        now = (time.perf_counter() if when is None else when) - self._t0
        # An allocation is stamped when its op started; never before what is already logged.
        now = max(now, self._last)
        self._last = now
        if kind == _BYTES:
            self.current += delta
            self.peak = max(self.peak, self.current)
        if self.keep_events:
            self._serials.append(serial)
            self._deltas.append(delta)
            self._kinds.append(kind)
            self._times.append(now)
            self._phases.append(self._phase())

    def on_alloc(self, serial: int, delta: int, when: float) -> None:
        self._log(serial, delta, _BYTES, when)

    def on_free(self, serial: int, nbytes: int, category: Category | None, when: float) -> None:
        if self.keep_events:
            self._freed_role[serial] = category
        self._log(serial, -nbytes, _BYTES, when)

    def on_discovered(self, serial: int, nbytes: int) -> None:
        # It existed all along: it raises every point of the region, the start included.
        self.before += nbytes
        self.current += nbytes
        self.peak += nbytes
        self._discovered[serial] = nbytes

    def on_mark(self, serial: int, category: Category) -> None:
        if self.keep_events:
            self._marks[serial] = stronger(self._marks.get(serial), category) or category

    def on_saved(self, serial: int, saved: bool) -> None:
        if self.keep_events:
            self._log(serial, 0, _SAVED if saved else _UNSAVED)

    # -- results ----------------------------------------------------------------------------
    def tally(self, breakdown: bool, used: Collection[int] = ()) -> Tally:
        """Totals, and (with events kept) categories at the peak and at the end, and the series.
        ``used``: serials of storages the region read (pre-existing ones among them are inputs).
        """
        after = self.ledger.total(self.device)
        if not self.keep_events:
            return Tally(self.before, after, self.peak, None, None, None, None, None, None)
        self._trim()
        left_out = self._left_out(used)
        before, after, peak = (x - sum(left_out.values()) for x in (self.before, after, self.peak))
        at_peak = at_end = highest = None
        if breakdown:
            at_peak, at_end, highest = self._categories(used, left_out)
        totals: array[int] = array("q")
        times: array[float] = array("d")
        phases: array[int] = array("b")
        running = before
        for i, kind in enumerate(self._kinds):
            if kind == _BYTES:
                running += self._deltas[i]
                totals.append(running)
                times.append(self._times[i])
                phases.append(self._phases[i])
        return Tally(before, after, peak, at_peak, at_end, highest, times, totals, phases)

    def _left_out(self, used: Collection[int]) -> dict[int, int]:
        """Bytes by serial of the storages below ``since`` that the region never touched (no
        event, no mark, not read): alive, and the same size, from its start to its end."""
        if not self.since:
            return {}
        touched = {*self._serials, *self._freed_role, *self._marks, *used}
        return {
            e.serial: e.nbytes
            for e in self.ledger.entries(self.device)
            if e.serial < self.since and e.serial not in touched
        }

    def _trim(self) -> None:
        """Drops an event a Ctrl-C cut off half-logged (the event arrays appended one by one):
        the arrays keep their common length, so an interrupted region's report still builds."""
        logs = (self._serials, self._deltas, self._kinds, self._times, self._phases)
        n = min(len(a) for a in logs)
        for a in logs:
            del a[n:]

    def _categories(
        self, used: Collection[int], left_out: dict[int, int]
    ) -> tuple[dict[Category, int], dict[Category, int], dict[Category, int]]:
        """Bytes per category at the peak, at the end, and the highest each reached.

        Only the storages the region touched (an event, a mark, a read) are followed one by one;
        the others kept one role throughout and are summed once, so a region's cost does not
        grow with the number of storages alive around it."""
        touched = set(self._serials)
        touched.update(self._freed_role, self._marks, used)
        marks = self._marks
        lasting: dict[int, Category | None] = {}
        size: dict[int, int] = {}
        saved: dict[int, bool] = {}
        still: dict[Category, int] = dict.fromkeys(Category, 0)
        ledger = self.ledger
        with ledger._lock:  # one consistent view: the total, the roles, the touched
            ledger.settle()
            total = ledger.total(self.device) - sum(left_out.values())
            # the ledger's own indexes (same floor): the touched by serial, and the few that
            # ever had a role or were saved for backward; no other live entry has either
            mine = [e for e in map(ledger._by_serial.get, touched) if e is not None]
            special = [e for e in ledger._special.values() if e.device == self.device]
            for entry in mine:
                if entry.device != self.device:
                    continue
                serial = entry.serial
                lasting[serial] = stronger(entry.category, marks.get(serial))
                size[serial] = entry.nbytes
                saved[serial] = entry.saved > 0
                total -= entry.nbytes
            # The untouched predate the region (a new storage has an event) and kept one role
            # throughout: their lasting one, else activation while saved, else other.
            for entry in special:
                if entry.serial not in touched and entry.serial not in left_out:
                    role_of = entry.category or (Category.ACTIVATION if entry.saved else None)
                    if role_of is not None:
                        still[role_of] += entry.nbytes
                        total -= entry.nbytes
            still[Category.OTHER] += total  # plain storages, never given a role
        for serial, freed_role in self._freed_role.items():
            lasting[serial] = stronger(freed_role, marks.get(serial))
            size[serial] = 0
            saved[serial] = False
        # Walk back from the end to each storage's size and saved state at the start.
        for i in range(len(self._kinds) - 1, -1, -1):
            serial, kind = self._serials[i], self._kinds[i]
            if kind == _BYTES:
                size[serial] -= self._deltas[i]
            else:
                saved[serial] = kind == _UNSAVED

        # Storages that predate the region, that it read and that were not already saved for
        # backward when it began: the region's inputs, whatever the region did with them.
        for serial in used:
            if self._predates(serial) and not saved.get(serial, True) and serial in lasting:
                lasting[serial] = lasting[serial] or Category.INPUT

        def fallback(serial: int) -> Category:
            if self._predates(serial):
                return Category.OTHER
            return Category.TEMPORARY if serial in self._freed_role else Category.OTHER

        def role(serial: int) -> Category:
            fixed = lasting[serial]
            if fixed is not None:
                return fixed
            return Category.ACTIVATION if saved[serial] else fallback(serial)

        sums: dict[Category, int] = dict.fromkeys(Category, 0)
        for serial, nbytes in size.items():
            if nbytes:
                sums[role(serial)] += nbytes
        best, best_total = dict(sums), sum(sums.values())
        highest = dict(sums)
        total = best_total
        for i, kind in enumerate(self._kinds):
            serial = self._serials[i]
            if kind == _BYTES:
                delta = self._deltas[i]
                sums[role(serial)] += delta
                size[serial] += delta
                total += delta
                if total > best_total:
                    best_total, best = total, dict(sums)
                category = role(serial)
                highest[category] = max(highest[category], sums[category])
            else:
                was = role(serial)
                saved[serial] = kind == _SAVED
                now = role(serial)
                if now is not was:
                    sums[was] -= size[serial]
                    sums[now] += size[serial]
                    highest[now] = max(highest[now], sums[now])

        def nonzero(d: dict[Category, int]) -> dict[Category, int]:
            return {c: d[c] + still[c] for c in Category if d[c] + still[c]}

        return nonzero(best), nonzero(sums), nonzero(highest)
