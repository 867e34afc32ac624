"""``memlab.track``: measure a region of code, the one entry point every front end uses."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch

import memlab.region.args as region_args
from memlab.core.accounting import Accountant
from memlab.core.categories import Category
from memlab.core.cuda import CudaRegion
from memlab.core.cuda_log import CudaLog, for_region
from memlab.core.devices import Target, resolve
from memlab.core.frames import misuse, users_traceback
from memlab.core.known import make_known
from memlab.core.ledger import Ledger
from memlab.core.native.eligible import NativeNotStartedError, eligible
from memlab.core.native.region import NativeRegion, hand_over_open
from memlab.core.recorder import Recorder
from memlab.core.warmup import warm_up
from memlab.region.args import alive, called, check_flag, check_label, check_since, weak_refs
from memlab.region.assemble import assemble
from memlab.region.labels import labelled
from memlab.region.overlap import notes as overlap_notes
from memlab.region.overlap import opened
from memlab.reports.report import MemoryReport, Reports


class track:  # noqa: N801  (used as a context manager, named like one)
    """Measure the memory a block of code uses.

    >>> with memlab.track(breakdown=True) as t:
    ...     loss = model(x).sum(); loss.backward()
    >>> t.report.peak_delta

    device: ``None`` (the current CUDA device, else the CPU), ``"cpu"``, ``"cuda:1"``, ``"meta"``,
        or ``"all"`` (every CUDA device). CUDA figures come from the caching allocator; other
        devices from exact tensor accounting.
    breakdown: also attribute bytes to categories (parameter, gradient, optimizer state,
        activation, ...) at the peak and at the end. On one GPU (without a timeline) it is read
        from the caching allocator's own log, its blocks and workspaces included.
    timeline: also record memory over time (``report.plot()``).
    reset_peak: reset the allocator's peak counter at the start (the default) so the peak is the
        region's own; ``False`` leaves it alone and the peak is "since the last reset".
    driver: also read the driver's view (``mem_get_info``, NVML) at the end.
    watch: modules, optimizers and tensors to know even if the region doesn't use them (and
        their roles, with a breakdown), or a function returning them (the magic passes the
        notebook's variables so), held weakly.
    inputs: tensors to count as the region's inputs.
    since: with a breakdown or a timeline, storages the ledger knew before this serial
        (``ledger.next_serial()``) that the region never touches are left out of its figures.
    """

    @users_traceback()  # (an argument refused: the error names it, without memlab's frames)
    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        breakdown: bool = False,
        timeline: bool = False,
        reset_peak: bool = True,
        driver: bool = False,
        label: str | None = None,
        watch: Iterable[Any] | Callable[[], Iterable[Any]] = (),
        inputs: Iterable[torch.Tensor] = (),
        ledger: Ledger | None = None,
        since: int = 0,
    ) -> None:
        self.targets: list[Target] = resolve(device)
        self.breakdown = check_flag("breakdown", breakdown)
        self.timeline = check_flag("timeline", timeline)
        self.reset_peak = check_flag("reset_peak", reset_peak)
        self.driver = check_flag("driver", driver)
        self.label = check_label(label)
        self._watch = region_args.watched(watch)
        self._inputs = weak_refs("inputs", inputs, (torch.Tensor,), "tensors")
        self._ledger: Ledger = region_args.check_ledger(ledger)
        self._since = check_since(since)
        self._accountant: Accountant | None = None
        self._recorders: dict[str, Recorder | NativeRegion | CudaLog] = {}
        self._native: NativeRegion | None = None
        #: A breakdown on one CUDA device read from the allocator's log (`memlab.core.cuda_log`).
        self._log: CudaLog | None = None
        self._cuda: dict[str, CudaRegion] = {}
        self._state = "new"
        self._overlapped: list[str] = []
        self._skipped: list[str] = []  # (the note on what `watch` named that raised)
        self._reports: Reports | None = None
        self._build_error: BaseException | None = None
        self._t0 = self._seconds = 0.0

    # -- the region -----------------------------------------------------------------------------
    @users_traceback()
    def __enter__(self) -> track:
        if self._state != "new":
            raise misuse("A track() object measures one region; create a new one.")
        self._state = "open"
        opened(self)
        accounted = self.breakdown or self.timeline or any(not t.is_cuda for t in self.targets)
        try:
            if accounted:
                self._ledger.resync()  # storages resized while no region was open
                keep = self.breakdown or self.timeline
                # on the CPU: the native record, no Python per op (no breakdown: `watch` only told
                # the ledger; with one, the record's hooks learn roles: `since` needs the mode)
                native = self._native_eligible() and not (keep and self._since)
                wanted = self.breakdown and not (self.timeline or self._since)
                log = for_region(self.targets, wanted, self._watched, lambda: alive(self._inputs))
                if log is not None:  # a breakdown on one GPU: the allocator's log
                    self._log = self._recorders[log.device] = log
                elif not native or (not keep and (self._watch or self._inputs)):
                    found = list(self._watched())
                    if not native or alive(self._inputs):
                        self._new_accountant(found)
                    elif found:
                        self._skipped = make_known(found, self._ledger, self._watch)
                if self._log is None and not (native and self._start_native(keep)):
                    acc = self._accountant or self._new_accountant()
                    for target in self.targets:
                        self._recorders[target.name] = Recorder(
                            self._ledger, target.name, keep, acc.phase, self._since
                        )
            for target in self.targets:
                if target.index is not None:
                    self._cuda[target.name] = CudaRegion(target.index, self.reset_peak)
            if self._log is not None:  # (started before the counters are read)
                self._log.counters = self._cuda[self._log.device]
            if self._recorders and self._native is None:
                hand_over_open()  # a native region open around this one: the ledger first
            for rec in self._recorders.values():
                if rec is not self._native:  # started already
                    rec.start()
            for cr in self._cuda.values():
                cr.begin()
            if self._accountant is not None and self._native is None:
                self._accountant.install()
                for t in alive(self._inputs):  # told again: the recorders listen now
                    self._accountant.mark(t, Category.INPUT)
        except BaseException as e:
            self._state = "failed"
            self._build_error = e  # (what `reports` says)
            overlap_notes(self)  # (no longer open)
            self._teardown()
            raise
        self._t0 = time.perf_counter()
        for rec in self._recorders.values():
            rec.set_origin(self._t0)
        return self

    def _new_accountant(self, found: list[Any] | None = None) -> Accountant:
        acc = self._accountant = Accountant(self._ledger, self.breakdown)
        acc.watch(acc.first_look(self._watched() if found is None else found, self.breakdown))
        for t in alive(self._inputs):
            acc.mark(t, Category.INPUT)
        return acc

    def _native_eligible(self) -> bool:
        return len(self.targets) == 1 and self.targets[0].name == "cpu" and eligible(self._ledger)

    def _start_native(self, keep: bool) -> bool:
        """Opens the native record (`memlab.core.native.eligible` said it can run), with a
        breakdown and timeline where ``keep``; False where it cannot start and the dispatch
        mode must measure."""
        native = NativeRegion.open(self._ledger, keep, saved=self.breakdown)
        if native is None:
            return False
        native.watched = self._watched
        warm_up()  # as the dispatch mode's install does: torch's one-time import, outside
        try:
            native.start()
        except NativeNotStartedError:  # another thread's region holds it: the dispatch mode
            return False
        self._native = self._recorders["cpu"] = native
        if native.roles is not None:
            for t in alive(self._inputs):
                native.roles.mark(t, Category.INPUT)
        return True

    @users_traceback()  # (misuse said without memlab's frames; a bug of memlab's keeps them)
    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state == "new":
            raise misuse("memlab.track: __exit__ without __enter__; use `with memlab.track():`")
        # A Ctrl-C while memlab closes the region waits until it is closed and its report built
        # (closing again resumes where it stopped); the report says so where the code had ended.
        deferred: KeyboardInterrupt | None = None
        for _ in range(3):
            try:
                self._close(et)
                break
            except KeyboardInterrupt as e:
                deferred = e
        if deferred is not None and et is None:
            self._reports = self._reports and self._reports.noted(region_args.CLOSED_THROUGH_CTRL_C)
            raise deferred

    def _close(self, et: type[BaseException] | None) -> None:
        try:
            try:
                for cr in self._cuda.values():
                    cr.finish()
                self._seconds = time.perf_counter() - self._t0
            finally:
                try:
                    self._teardown()
                finally:  # (once: a close tried again after a Ctrl-C keeps the first's)
                    self._overlapped = self._overlapped or overlap_notes(self)
            self._reports = Reports(tuple(self._assemble(t, et) for t in self.targets))
        except Exception as e:  # never mask the region's own exception with ours
            self._build_error = e
            if et is None:
                raise
        finally:
            self._state = "closed"

    def _teardown(self) -> None:
        acc = self._accountant
        try:
            if acc is not None:
                acc.uninstall()
                if self._state == "open" and self.breakdown:
                    acc.watch(self._watched())
                    acc.finish()
        finally:
            try:
                for rec in self._recorders.values():
                    rec.stop()
            finally:
                for cr in self._cuda.values():
                    cr.close()

    @users_traceback()
    def mark(self, t: torch.Tensor, category: Category) -> None:
        """Tell the open region what a tensor is (e.g. an input created inside the region)."""
        if self._state != "open":
            raise misuse("mark() works inside the region's `with` block.")
        if self._accountant is not None:
            self._accountant.mark(t, category)
        elif self._native is not None and self._native.roles is not None:
            self._native.roles.mark(t, category)
        elif self._native is not None:  # (without roles: the ledger knows it from the start)
            self._ledger.classify(t, category)
        elif self._log is not None:
            self._log.mark(t, category)

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Label the timeline's events inside the block ``name``, "prefill" (a prompt read at
        once) or "decode" (tokens one at a time), where they would say "forward" or "other"."""
        return labelled(self._accountant, self._native, name)

    def _watched(self) -> Iterable[Any]:
        return called(self._watch) if callable(self._watch) else alive(self._watch)

    # -- results --------------------------------------------------------------------------------
    @property
    @users_traceback()
    def reports(self) -> Reports:
        if self._state in ("new", "open"):
            raise misuse("The region is still open: read .report after the `with` block.")
        if self._state == "failed":
            raise region_args.not_started(self._build_error)
        if self._reports is None:
            raise RuntimeError("memlab could not build this report.") from self._build_error
        return self._reports

    @property
    def lost(self) -> int:
        """Ops (or names) the accounting failed to take in; the report's notes say why."""
        parts = (self._native, self._log, self._accountant)
        return sum(p.lost for p in parts if p is not None)

    @property
    @users_traceback()
    def report(self) -> MemoryReport:
        """The report of the first (usually the only) device."""
        return self.reports[0]

    def _assemble(self, target: Target, raised: type[BaseException] | None) -> MemoryReport:
        rec, acc = self._recorders.get(target.name), self._accountant
        return assemble(
            target,
            rec.tally(self.breakdown, acc.used if acc else ()) if rec is not None else None,
            self._cuda.get(target.name),
            seconds=self._seconds,
            label=self.label,
            raised=raised,
            notes=[
                *(acc.errors if acc else self._skipped),
                *(n for r in (self._native, self._log) if r is not None for n in r.notes),
                *self._overlapped,
            ],
            timeline=self.timeline,
            driver=self.driver,
        )
