"""Pre-flight: a cell tracked on the CPU, its allocation stream replayed through the allocator
model of a GPU (``%%gpumem --gpu T4``). Would it run out of memory there, at which line, and
what would make it fit.

`Flight` is a ledger listener, attached before the cell's region opens so that it also sees the
storages the region discovers (the model built in an earlier cell is on the GPU too). Each
allocation is stamped with the innermost line of the cell's own file on the stack. At the first
simulated out-of-memory it keeps the cache, the live storages and the variables that hold them;
the explanation is built when the cell ends, once every storage's role is known.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from memlab.core.categories import Category, stronger
from memlab.core.ledger import Ledger
from memlab.estimate.allocator import CachingAllocator, SimulatedOutOfMemoryError
from memlab.estimate.amp import AmpStream
from memlab.estimate.autocast import own_autocast
from memlab.estimate.catches import catching, innermost, on_stack
from memlab.estimate.cuda_calls import simulated
from memlab.estimate.gpus import GPU
from memlab.estimate.holders import variable_names, variable_root
from memlab.estimate.oom import explain, replay_peak, stream_levers
from memlab.estimate.redirect import redirected
from memlab.reports.oom import Lever, LiveTensor
from memlab.reports.preflight import Preflight
from memlab.reports.units import fmt_bytes

#: The levers replay the cell's stream a few times each; beyond this many events they are left
#: out (and the explanation says so), to keep the answer within seconds.
MAX_LEVER_EVENTS = 300_000


@dataclass
class _Failure:
    requested: int
    line: int | None
    segments: list[dict[str, Any]]
    live: list[tuple[int, int]]  # (serial, bytes)
    saved: set[int]
    names: dict[int, list[str]]
    #: The storages live before the cell did not fit on the card, the cell not yet begun.
    before: bool = False
    stack: tuple[int, ...] = ()  # (the cell's lines running then, innermost first)


class Flight:
    """Replays one device's allocations through the allocator model of ``card``."""

    def __init__(
        self,
        card: GPU,
        ledger: Ledger,
        namespace: dict[str, Any],
        hidden: Container[str] = (),
        device: str = "cpu",
    ) -> None:
        self.card, self.ledger, self.device = card, ledger, device
        self.namespace, self.hidden = namespace, hidden
        self.filename: str | None = None
        self.allocator = CachingAllocator(card.usable)
        self.stream: list[tuple[int, int]] = []
        self.sizes: dict[int, int] = {}
        self.handles: dict[int, int] = {}
        self.lines: dict[int, int] = {}
        self.marks: dict[int, Category] = {}
        self.saved: set[int] = set()
        self.ever_saved: set[int] = set()
        self.before: set[int] = set()
        self.freed: set[int] = set()
        self.failure: _Failure | None = None
        self.amp = AmpStream(ledger)  # the stream as autocast would make it: the AMP lever
        self._begun = False  # the cell allocated (or ended): later discoveries are mid-cell
        self._modes = contextlib.ExitStack()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, filename: str) -> None:
        """Attach; ``filename``: the cell's, whose lines stamp the allocations. Until `stop`,
        code written for CUDA (``.cuda()``, ``torch.autocast("cuda")``) runs on the CPU."""
        self.filename = filename
        with self.ledger._lock:
            for e in self.ledger.entries(self.device):
                if e.category is not None:
                    self.marks[e.serial] = e.category
                if e.saved:
                    self.saved.add(e.serial)
                self.on_discovered(e.serial, e.nbytes)
            self.ledger.attach(self)
        self._modes.enter_context(redirected(self.device))
        self._modes.enter_context(own_autocast([]))  # casting as that GPU would
        self._modes.enter_context(simulated(lambda: self.allocator.stats, self.card))

    def stop(self, raised: str | None = None, lost: int = 0) -> Preflight:
        """Detach; the verdict. ``raised``: what the cell raised, if it stopped; ``lost``: ops
        the accounting failed to take in (then no verdict)."""
        try:
            self.ledger.detach(self)
        finally:
            self._modes.close()
        return dataclasses.replace(self.result(), raised=raised, lost=lost)

    # -- ledger callbacks ------------------------------------------------------------------------
    def on_alloc(self, serial: int, delta: int, when: float) -> None:
        self._began()
        old = self.sizes.pop(serial, None)
        if old is not None:  # a storage that grew: the allocator sees a new block
            self._free(serial, old)
        self._malloc(serial, (old or 0) + delta, innermost(self.filename))

    def on_free(self, serial: int, nbytes: int, category: Category | None, when: float) -> None:
        if category is not None:
            self.on_mark(serial, category)
        size = self.sizes.pop(serial, None)
        if size is not None:
            self._free(serial, size)
            self.freed.add(serial)

    def on_discovered(self, serial: int, nbytes: int) -> None:
        self.before.add(serial)
        self._malloc(serial, nbytes, None)

    def on_mark(self, serial: int, category: Category) -> None:
        self.marks[serial] = stronger(self.marks.get(serial), category) or category

    def on_saved(self, serial: int, saved: bool) -> None:
        if saved:
            self.saved.add(serial)
            self.ever_saved.add(serial)
        else:
            self.saved.discard(serial)

    # -- the replay ------------------------------------------------------------------------------
    def _malloc(self, serial: int, nbytes: int, line: int | None) -> None:
        if nbytes <= 0:
            return
        self.sizes[serial] = nbytes
        self.stream.append((serial, nbytes))
        self.amp.malloc(serial, nbytes)
        if line is not None:
            self.lines[serial] = line
        if self.failure is not None:
            return  # past the first failure the simulated GPU's state means nothing
        try:
            self.handles[serial] = self.allocator.malloc(nbytes)
        except SimulatedOutOfMemoryError:
            # a storage from before the cell, none of the cell's own yet: what earlier cells
            # left does not fit (the rest of it is added until the cell's first allocation)
            before = line is None and not self._begun and serial in self.before
            self.failure = _Failure(
                nbytes,
                line,
                self.allocator.segments(),
                [(s, self.sizes[s]) for s in self.handles],
                set(self.saved),
                self._names(),
                before,
                on_stack(self.filename),
            )

    def _began(self) -> None:
        """The cell's first allocation (or end): what earlier cells left, where it did not fit."""
        if self._begun:
            return
        self._begun = True
        found = self.failure
        if found is not None and found.before:
            found.live = [(s, n) for s, n in self.sizes.items() if s in self.before]
            found.names = self._names()

    def _names(self) -> dict[int, list[str]]:  # (none where the namespace cannot be read)
        try:
            return variable_names(self.ledger, self.namespace, self.hidden)
        except Exception:
            return {}

    def _free(self, serial: int, nbytes: int) -> None:
        self.stream.append((serial, -nbytes))
        self.amp.free(serial, nbytes)
        handle = self.handles.pop(serial, None)
        if handle is not None:
            self.allocator.free(handle)

    # -- the result ------------------------------------------------------------------------------
    def role(self, serial: int, saved: set[int]) -> str:
        mark = self.marks.get(serial)
        if mark is not None:
            return str(mark)
        if serial in saved:
            return str(Category.ACTIVATION)
        if serial in self.freed and serial not in self.before:
            return str(Category.TEMPORARY)
        return str(Category.OTHER)

    def result(self) -> Preflight:
        self._began()
        stats = self.allocator.stats
        found = self.failure
        if found is None:
            return Preflight(
                _label(self.card), self.card.usable, stats.peak_allocated, stats.peak_reserved
            )
        # past the failure the replay stopped: what the whole cell needs, on an unlimited card
        unlimited = replay_peak(self.stream, lambda s, n: n, None)
        before = sum(n for _, n in found.live) if found.before else 0
        caught = catching(self.filename, found.stack)  # (the GPU would run its except branch)
        usable, peak, why = self.card.usable, stats.peak_allocated, self._explain(found)
        return Preflight(
            _label(self.card), usable, peak, unlimited, why, before=before, caught_at=caught
        )

    def _explain(self, found: _Failure) -> Any:
        def source(line: int | None, serial: int | None = None) -> str:
            if line is None or self.filename is None:
                return "before this cell" if serial in self.before else ""
            return linecache.getline(self.filename, line)

        def at(s: int, n: int) -> LiveTensor:
            role, line = self.role(s, found.saved), self.lines.get(s)
            return LiveTensor(n, role, tuple(found.names.get(s, ())), line, source(line, s))

        live = [at(s, n) for s, n in found.live]
        holding: dict[str, list[int]] = {}
        for s, _ in found.live:  # what the user could drop: none of the step's own storages
            # (where what earlier cells left does not fit, any of it: the user knows which)
            if found.before or self.role(s, found.saved) == str(Category.OTHER):
                for name in found.names.get(s, ()):
                    holding.setdefault(variable_root(name), []).append(s)
        later = f"once it is no longer needed, before line {found.line}"
        held = {
            name: (serials, "before this cell" if self.before.issuperset(serials) else later)
            for name, serials in holding.items()
        }
        roles = {s: self.role(s, self.ever_saved) for s, n in self.stream if n > 0}
        for s in self.before:  # from before the cell and read by autograd: the input batch
            if roles.get(s) == str(Category.ACTIVATION):
                roles[s] = str(Category.INPUT)
        probe = explain(
            where="", requested=found.requested, capacity=self.card.usable, segments=found.segments
        )
        levers: list[Lever] = []
        how = (
            "levers are predicted by replaying this cell's allocations, changed as each lever "
            "would change them, through the allocator model"
        )
        if len(self.stream) <= MAX_LEVER_EVENTS:
            amp = self.amp.stream(roles) if self.amp.changes else None  # (none: no AMP lever)
            levers = stream_levers(
                self.stream, roles, self.card.usable, held, probe.fragmented, amp
            )
        else:  # each lever replays the stream: ~1 s per 100,000 events
            how = (
                f"levers left out: the cell made {len(self.stream):,} allocations and frees, "
                f"more than the {MAX_LEVER_EVENTS:,} replayed for them; pre-flight one step"
            )
        explained = explain(
            where=f"predicted {_label(self.card)}",
            requested=found.requested,
            capacity=self.card.usable,
            segments=found.segments,
            live=live,
            levers=levers,
            line=found.line,
            source=source(found.line),
            notes=(
                f"usable: {_label(self.card)} less {self.card.context // 2**20} MiB for the "
                "CUDA context; cuBLAS workspaces and CUDA-only buffers not included",
                how,
            ),
        )
        if not found.before:
            return explained
        left = sum(n for _, n in found.live)
        cause = (
            f"what earlier cells left on the device ({fmt_bytes(left)}) does not fit in the "
            f"{fmt_bytes(self.card.usable)} usable: the cell could not begin"
        )
        return dataclasses.replace(explained, cause=cause, fragmented=False)


def _label(card: GPU) -> str:
    """ "T4 (16 GiB)"; a card given by its size: "24.0 GiB GPU"."""
    if card.name.startswith("custom "):
        return f"{fmt_bytes(card.memory)} GPU"
    return card.describe()
