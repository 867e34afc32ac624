"""Exact tensor accounting on any device: a dispatch mode that sees every storage an op returns.

``Accountant`` installs, for one region, a ``TorchDispatchMode`` that registers each storage in
the ledger (inputs first, so views and in-place results of older tensors are not mistaken for new
memory), and, when a breakdown is asked for, the hooks that learn each storage's role. Everything
is removed in ``uninstall()``, which the region calls in ``finally``.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from memlab.core import _torch, fork, older_graphs, transforms  # noqa: F401  (fork: registers its handler)
from memlab.core._torch import OwnedMode
from memlab.core._torch_record import unseen
from memlab.core.autograd import iter_nodes
from memlab.core.categories import Category
from memlab.core.collectives import Collectives, is_collective
from memlab.core.cuda_names import is_log_pack
from memlab.core.frames import described
from memlab.core.ledger import Ledger, storage_of
from memlab.core.native import joiner
from memlab.core.native.objects import HANDED
from memlab.core.native.roles import native_pack
from memlab.core.older_graphs import unpack as _unpack
from memlab.core.recorder import Phase
from memlab.core.resizes import following_resizes
from memlab.core.roles import Roles
from memlab.core.storages import op_tensors, sparse_parts
from memlab.core.warmup import warm_up
from memlab.core.warn import quiet_compile_hooks

_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_DETACH = torch.Tensor.detach


class _Mode(OwnedMode):
    def __init__(self, accountant: Accountant) -> None:
        super().__init__()
        self.accountant = accountant

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        acc = self.accountant
        if acc.comms.pending:
            acc.comms.adopt(args, kwargs)
        if func is not _LIFT_FRESH:  # torch.tensor(...)'s new memory: counted as its output
            acc.see_inputs(args, kwargs)
        started = time.perf_counter()  # an op takes its output memory when it starts
        out = func(*args, **(kwargs or {}))
        acc.see_outputs(out, started)
        if is_collective(func):
            acc.comms.seen(func, args, kwargs, out)
        return out


class Accountant(Roles):
    """Owns one region's dispatch mode and role hooks over a ledger."""

    def __init__(self, ledger: Ledger, breakdown: bool) -> None:
        self.ledger = ledger
        self.breakdown = breakdown
        self.errors: list[str] = []
        #: Ops whose tensors the bookkeeping failed to take in (their bytes may be missing).
        self._lost = 0
        self._failures = ledger.failures  # (its listeners' before the region: `lost`, after)
        self._missed: int | None = None
        self._leaves: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: id -> weak references to each leaf remembered and to its storage then.
        self._leaf_refs: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}
        #: (storage id, role) -> weak reference to the storage, for each role told the ledger.
        self._marked: dict[tuple[int, Category], weakref.ref[torch.UntypedStorage]] = {}
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._stack = contextlib.ExitStack()
        self._module_depth = self._optimizer_depth = 0
        #: A phase the front end labelled (`memlab.track.phase`), 0 when none (while set, it
        #: stands for "forward" and "other"; one attribute read on the per-event path).
        self.labelled = 0
        self._sweep_queued = False
        self._mode: _Mode | None = None
        #: What makes a saved tensor's alias (see `_pack`).
        self._alias: Any = _DETACH
        self.comms = Collectives(ledger, self._error)
        #: Serials of the storages the region's ops read.
        self.used: set[int] = set()

    # -- install / uninstall ------------------------------------------------------------------
    def install(self) -> None:
        """Enter the mode and hooks; on any failure, undo what was done and re-raise."""
        # roles told before the region's recorders listened (`watch`, `inputs`) are told again
        self._marked.clear()
        self._leaf_refs.clear()
        warm_up()  # before the region's clock starts (track() starts it after install)
        try:
            if self.breakdown:
                self._install_role_hooks()
            self._stack.enter_context(following_resizes(self.ledger.resized))
            unjoin = joiner.follow(None)  # (threads it started: said, not counted)
            self._stack.callback(lambda: self.errors.extend(unjoin()))
            mode = _Mode(self)
            self._stack.enter_context(mode)
            self._mode = mode
        except BaseException:
            self._stack.close()
            raise

    def uninstall(self) -> None:
        self._stack.close()
        mode = self._mode  # (None: a native region's, never installed: its record says failures)
        if mode is not None and mode.misplaced:
            self.errors.append(mode.misplaced)
        self.ledger.settle()  # the region's last frees, heard (or not) before the count
        missed = self.ledger.missed_since(self._failures, self.errors) if mode is not None else 0
        self._missed = missed

    @property
    def lost(self) -> int:
        """Ops and ledger events the bookkeeping failed to take in during the region."""
        missed = self._missed if self._missed is not None else self.ledger.failures - self._failures
        return self._lost + missed

    def _install_role_hooks(self) -> None:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        hooks = (
            nn_module.register_module_forward_pre_hook(self._module_pre),
            nn_module.register_module_forward_hook(self._module_post, always_call=True),
            optim_module.register_optimizer_step_pre_hook(self._optimizer_pre),
            optim_module.register_optimizer_step_post_hook(self._optimizer_post),
        )
        for handle in hooks:
            self._stack.callback(handle.remove)
        self._stack.callback(quiet_compile_hooks())
        self._stack.callback(self.kv_caches_in())
        on = transforms.in_force()  # (memlab's stale pairs taken off)
        if on is not None and (on[0] is native_pack() or is_log_pack(on[0])):
            # a native region or a CUDA log is open around this one: its pack makes the aliases
            self._alias = on[0]
        elif on is not None and not isinstance(getattr(on[0], "__self__", None), Accountant):
            # only the top pair applies: memlab's would replace the program's (say, offloading
            # activations with save_on_cpu), so the program's stay in force
            self.errors.append(
                "activations not tagged: the program's own saved_tensors_hooks are in force"
            )
            return
        try:
            _torch.push_saved_tensors_hooks(self._pack, _unpack)
        except RuntimeError as e:  # saved-tensor hooks disabled by the program (e.g. FSDP)
            self.errors.append(f"activations not tagged: {e}")
            return
        self._stack.callback(self._remove_saved_tensors_hooks)
        transforms.install(self._pack, _unpack, self._stepped_aside)

    def _remove_saved_tensors_hooks(self) -> None:
        transforms.uninstall(self._pack)
        if not _torch.remove_saved_tensors_hooks(self._pack):
            self.errors.append("memlab's saved_tensors_hooks were removed by other code")

    # -- the dispatch path --------------------------------------------------------------------
    def see_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
        try:
            tensors = op_tensors(args)
            if kwargs:
                tensors += op_tensors(kwargs.values())
            for a in tensors:
                st = storage_of(a)
                if st is None:
                    for part in sparse_parts(a):  # a sparse tensor: its indices and values
                        entry = self.ledger.existing(part, part.untyped_storage())
                        if self.breakdown:
                            self.used.add(entry.serial)
                    continue
                entry = self.ledger.existing(a, st)
                if self.breakdown:
                    self.used.add(entry.serial)
                    if a.requires_grad and a.is_leaf:
                        self._remember_leaf(a, st)
                    elif entry.category is None and isinstance(a, torch.nn.Parameter):
                        # a frozen one whose module never ran here: an EMA copy of the model
                        self.ledger.classify(a, Category.PARAMETER)
        except Exception as e:  # never break the user's op for our bookkeeping
            self._lost += 1
            self._error(e)

    def see_outputs(self, out: Any, started: float) -> None:
        try:
            if out is None:
                return
            for t in op_tensors(out if isinstance(out, (list, tuple, torch.Tensor)) else (out,)):
                st = storage_of(t)
                if st is not None:
                    self.ledger.produced(t, st, started)
                else:  # a sparse tensor: its indices and values hold its bytes
                    for part in sparse_parts(t):
                        self.ledger.produced(part, part.untyped_storage(), started)
            node = _torch.current_autograd_node() if self.breakdown else None
            if node is None:  # no backward runs: a queued one raised (its callback never ran)
                self._sweep_queued = False
            elif not self._sweep_queued:  # a backward's first op (one run inside it queues none)
                self._sweep_queued = True
                self._remember_leaves_of(node)
                _torch.queue_backward_callback(self._after_backward)
        except Exception as e:
            self._lost += 1
            self._error(e)

    def _error(self, e: Exception, what: str = "") -> None:
        if len(self.errors) < 5:
            said = described(e)  # (safe from an exception whose __str__ raises too)
            self.errors.append(f"{what} ({said})" if what else said)

    def _safely(self, what: str, fn: Any, *args: Any) -> None:
        """``fn(*args)`` on the user's objects, from a hook or a sweep, unseen by the program's
        torch function modes; their own error is noted, never raised into the user's step."""
        try:
            with unseen():
                fn(*args)
        except Exception as e:
            self._error(e, what)

    def phase(self) -> int:
        if _torch.current_autograd_node() is not None:
            return Phase.BACKWARD
        if self._optimizer_depth:
            return Phase.OPTIMIZER
        if self.labelled:
            return self.labelled
        if self._module_depth:
            return Phase.FORWARD
        return Phase.OTHER

    # -- roles ---------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # Returning ``t`` itself would tie a saved output to its own grad_fn in a cycle that
        # even gc cannot free; a detached alias saves the same storage without it, and its
        # death tells us when autograd lets the storage go.
        packed: torch.Tensor = self._alias(t)
        try:
            self.ledger.saved_by(t, packed)
            if self._alias is native_pack():  # the native record's alias: the ledger has it
                HANDED[packed] = True
        except Exception as e:
            self._error(e)
        return packed

    def _module_pre(self, module: torch.nn.Module, args: Any) -> None:
        self._module_depth += 1
        self._safely("a module's roles not read", self.watch_module, module, False)

    def _module_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._module_depth = max(0, self._module_depth - 1)

    def _optimizer_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_depth += 1
        self._safely(_OPT, self.watch_optimizer, opt)

    def _optimizer_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)
        self._safely(_OPT, self.watch_optimizer, opt)

    def _remember_leaves_of(self, node: Any) -> None:
        """The leaves this backward gives gradients to (its AccumulateGrad nodes' variables): a
        region that runs only backward never saw the forward that says what is a parameter."""
        for n in iter_nodes([node]):
            if isinstance(leaf := getattr(n, "variable", None), torch.Tensor):
                self._remember_leaf(leaf)

    def _after_backward(self) -> None:
        self._sweep_queued = False
        self.sweep_gradients()

    def sweep_gradients(self) -> None:
        for leaf in list(self._leaves.keys()):
            self._safely("a gradient not read", self._mark_grad, leaf)

    def _mark_grad(self, leaf: torch.Tensor) -> None:
        if (grad := leaf.grad) is not None:
            self.mark(grad, Category.GRADIENT)

    def finish(self) -> None:
        """Last look before the report: parameters in new memory (a cast), gradients,
        optimizer states, older graphs released."""
        older_graphs.released()
        self.ledger.settle()
        for leaf in list(self._leaves.keys()):  # (as the native record's end does)
            self._safely("a parameter's role not read", self._remember_leaf, leaf)
            self._safely("a gradient not read", self._mark_grad, leaf)
        for opt in list(self._optimizers):
            self._safely(_OPT, self.watch_optimizer, opt)


_OPT = "an optimizer's roles not read"
