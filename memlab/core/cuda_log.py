"""A CUDA region's breakdown from the caching allocator's own log: no Python of memlab's per op.

``CudaLog`` stands in for a `memlab.core.recorder.Recorder` (start, set_origin, stop, tally)
for one CUDA device, where a region asks for a breakdown (not a timeline). While it is open:

* the caching allocator records its history (`torch.cuda.memory._record_memory_history`,
  without stack frames, only its allocations and frees where PyTorch can leave the rest out):
  every block it hands out and takes back is logged in C++, whatever runs (eager ops, compiled
  code, library kernels, their workspaces);
* a few hooks name addresses at known moments (`memlab.core.cuda_names`): each tensor autograd
  saves, the gradients an optimizer is about to use, the inputs of a module called at the top,
  what a Hugging Face cache holds;
* at the end one snapshot gives the log and the blocks alive, and the modules called at the
  top, the optimizers that stepped and the objects watched name what is alive (parameters,
  buffers, gradients, state).

`memlab.core.cuda_settle.settle` then replays the log once, when the breakdown is first read
(`memlab.core.cuda_later`). The figures are the allocator's
blocks, its rounding and the libraries' workspaces included: at the end they add up to
``memory_allocated()`` to the byte. Where the log cannot be used (the program records the
history itself, another region reads it, ``MEMLAB_CUDA_LOG=0``), the dispatch mode measures.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import optimizer as optim_module

from memlab.core import _torch, cuda_claim, cuda_older, kv_caches, transforms
from memlab.core._torch_history import cuda_history_on, start_cuda_log, watch_history
from memlab.core.categories import Category
from memlab.core.cuda_later import Later, defer
from memlab.core.cuda_names import Names, log_unpack, now_us
from memlab.core.cuda_trace import active_blocks
from memlab.core.native.roles import native_pack
from memlab.core.older_graphs import unpack as _unpack
from memlab.core.recorder import Tally
from memlab.core.warn import quiet_compile_hooks

#: Events the allocator keeps for a region (about 100 bytes each in C++, and a Python dict each
#: when read back: a long training loop in one cell would cost seconds); past them it drops
#: the oldest, and the report says the breakdown may miss an earlier peak.
MAX_EVENTS = 500_000


def is_accountant_pack(hook: Any) -> bool:
    from memlab.core.accounting import Accountant  # (it imports this module's neighbours)

    return isinstance(getattr(hook, "__self__", None), Accountant)


class CudaLog:
    """One CUDA region's breakdown, read from the allocator's log (see the module's text)."""

    def __init__(self, index: int, device: str) -> None:
        self.index, self.device = index, device
        self.notes: list[str] = []
        self.names = Names()
        #: What the region watches (`memlab.track`'s ``watch``), named at the end.
        self.watched: Callable[[], Iterable[Any]] = tuple
        #: The tensors to count as the region's inputs (`memlab.track`'s ``inputs``).
        self.inputs: Callable[[], Iterable[torch.Tensor]] = tuple
        #: The region's `memlab.core.cuda.CudaRegion`: the allocator's figure at the start.
        self.counters: Any = None
        self._stack = contextlib.ExitStack()
        self._events: list[dict[str, Any]] | None = None
        self._blocks: list[tuple[int, int]] = []
        self._t0 = 0.0
        self._state = "new"
        self._complete = True
        self._history_ours = False
        #: Whether the program set the allocator's history itself inside the region.
        self._history_taken = False
        #: Blocks graphs from before the region hold saved (their addresses), the outputs
        #: behind them (weakly), and those of the blocks no longer saved at the end.
        self._saved_before: list[int] = []
        self._outputs: list[weakref.ref[torch.Tensor]] = []
        self._released: set[int] = set()
        self._later: Later | None = None  # (the replay, once `tally` made it)

    # -- the region -----------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the log and the hooks (the log was claimed for this region by `for_region`)."""
        self._t0 = now_us()
        self._state = "starting"  # (a Ctrl-C from here on still stops the history)
        try:
            self._history_ours = True
            start_cuda_log(MAX_EVENTS)
        except Exception as e:  # the region goes on without a breakdown, and says why
            self.notes.append(f"no breakdown: the allocator's history did not start ({e})")
            self._state = "failed"
            return
        self._state = "open"
        try:
            self._install()
            for t in self.inputs():
                self.mark(t, Category.INPUT)
            self._saved_before = self._older_graphs()
        except BaseException:
            self.stop()
            raise

    def _older_graphs(self) -> list[int]:
        """The blocks graphs from before the region hold saved (`memlab.core.cuda_older`)."""
        addresses, self._outputs, notes = cuda_older.saved_at_start(self.watched)
        self.notes.extend(notes)
        return addresses

    def set_origin(self, t0: float) -> None:
        pass

    def forked(self) -> None:
        """In a child forked while the region was open: its hooks off, and no CUDA call."""
        self._state, self._events, self._history_ours = "named", None, False
        self._stack.close()
        self.names.clear()

    @property
    def lost(self) -> int:
        return self.names.lost

    def mark(self, t: torch.Tensor, category: Category) -> None:
        self.names.mark(t, category)

    def _install(self) -> None:
        # the program setting the history itself inside the region: it is then the program's
        self._stack.callback(watch_history(lambda: setattr(self, "_history_taken", True)))
        handle = optim_module.register_optimizer_step_pre_hook(self.names.optimizer_pre)
        self._stack.callback(handle.remove)
        self._stack.callback(quiet_compile_hooks())
        self.names.arm()
        self._stack.callback(self.names.disarm)
        self._stack.callback(kv_caches.named_by(self.names.mark))
        on = transforms.in_force()  # (memlab's stale pairs taken off)
        if on is not None and (on[0] is native_pack() or is_accountant_pack(on[0])):
            self.names.alias = on[0]  # memlab's region around this one tags what is saved too
        elif on is not None:  # the program's own pair stays in force (offloading, say)
            self.notes.append(
                "activations not named: the program's own saved_tensors_hooks are in force"
            )
            return
        # (its own unpack hook, unless memlab's region around it tags: a graph built here is
        # walked by later regions, as one built without memlab is)
        unpack = _unpack if self.names.alias is not torch.Tensor.detach else log_unpack
        try:
            _torch.push_saved_tensors_hooks(self.names.pack, unpack)
        except RuntimeError as e:  # saved-tensor hooks disabled by the program
            self.notes.append(f"activations not named: {e}")
            return
        self._stack.callback(self._remove_pack)
        transforms.install(self.names.pack, unpack, self._stepped_aside)

    def _remove_pack(self) -> None:
        transforms.uninstall(self.names.pack)
        if not _torch.remove_saved_tensors_hooks(self.names.pack):
            self.notes.append("memlab's saved_tensors_hooks were removed by other code")

    def _stepped_aside(self) -> None:
        said = "what autograd saved under torch.func (its hooks stepped aside) is not named"
        if said not in self.notes:
            self.notes.append(said)

    def stop(self) -> None:
        """Takes the hooks off, reads the log and stops it, then names what the objects hold
        (each step once: a close tried again after a Ctrl-C goes on where it stopped)."""
        if self._state not in ("stopped", "named"):
            try:
                self._stack.close()
            finally:
                try:
                    if self._state == "open":
                        self._read()
                finally:
                    self._state = "stopped"
                    cuda_claim.release(self)
                    ours = self._history_ours and not self._history_taken  # (not the program's)
                    if ours and cuda_history_on():  # (a Ctrl-C in the read)
                        with contextlib.suppress(Exception):
                            _torch.record_memory_history(False)
        if self._state == "stopped":
            if self._events is None:
                self.names.clear()  # (no breakdown: nothing of the user's kept)
            else:
                try:
                    watched = list(self.watched())
                    cuda_older.known(watched)
                except Exception:  # the watch function raised: the objects that ran still name
                    watched = []
                self.names.at_end(watched)
                self._released = cuda_older.released(self._outputs, self._saved_before)
        self._state = "named"

    def _read(self) -> None:
        try:
            if not cuda_history_on():
                self.notes.append(
                    "no breakdown: other code turned the allocator's history off inside the region"
                )
                return
            try:
                snap = _torch.memory_snapshot()
            except Exception as e:  # never the user's cell's problem
                self.notes.append(f"no breakdown: the allocator's log could not be read ({e})")
                return
        finally:
            self._history_ours = False
            if self._history_taken:
                self.notes.append(
                    "the program set the allocator's history itself inside the region: it is "
                    "left as the program set it, and the breakdown reads the log as it was kept"
                )
            else:
                with contextlib.suppress(Exception):
                    _torch.record_memory_history(False)
        traces = snap.get("device_traces") or []
        events = traces[self.index] if self.index < len(traces) else []
        # (the program's own setting may have cleared the log or bounded it)
        self._complete = len(events) < MAX_EVENTS and not self._history_taken
        t0 = self._t0 - 1000
        if events and events[0].get("time_us", t0) < t0:  # an earlier recording's (2.4 kept them)
            events = [e for e in events if e.get("time_us", t0) >= t0]
        self._events = events
        self._blocks = active_blocks(snap, self.index)

    # -- results --------------------------------------------------------------------------------
    def tally(self, breakdown: bool, used: Any = ()) -> Tally:
        before = int(self.counters.start.allocated) if self.counters is not None else 0
        if self._events is None:
            if not any(n.startswith("no breakdown") for n in self.notes):
                self.notes.append("no breakdown: the allocator's log was not read (interrupted)")
            return _no_breakdown(before)
        if self._later is None:  # (a close tried again after a Ctrl-C: the same replay)
            names = self.names
            self._later = Later(
                self._events,
                before,
                self._blocks,
                names.named,
                args=names.args,
                saved_before=self._saved_before,
                released=self._released,
                unsaved=names.unsaved,
                complete=self._complete and not names.trimmed,
                limit=MAX_EVENTS,
            )
            names.clear()  # (its lists stay the replay's: clearing makes new ones)
            self._events, self._blocks = [], []  # (the log is the replay's alone now)
            defer(self._later)  # (older logs replayed here: a Ctrl-C in one leaves this whole)
        return Tally(before, before, before, None, None, None, None, None, None, self._later)


def for_region(
    targets: list[Any],
    wanted: bool,
    watched: Callable[[], Iterable[Any]],
    inputs: Callable[[], Iterable[torch.Tensor]],
) -> CudaLog | None:
    """The log for a region on ``targets`` where ``wanted`` (a breakdown without a timeline or
    ``since``), it has one CUDA device and the log can be read now (`cuda_claim.why_not`); else
    None."""
    one = targets[0] if len(targets) == 1 else None
    if not wanted or one is None or one.index is None:
        return None
    log = CudaLog(one.index, one.name)
    if not cuda_claim.claim(log):  # (two threads' regions never both find the log free)
        return None
    log.watched, log.inputs = watched, inputs
    return log


def _no_breakdown(before: int) -> Tally:
    return Tally(before, before, before, None, None, None, None, None, None)
