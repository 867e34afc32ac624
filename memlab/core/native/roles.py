"""The roles of a native region with a breakdown: what Python still has to say, said cheaply.

The native record follows ops, allocations, saved tensors and gradients in C++. Python tells it
what only Python knows, through hooks that do little per call:

* the phase (forward in a module, the optimizer's step, a label the front end set): one integer
  written into the library at each module and optimizer hook (a backward is found in C++);
* parameters and buffers, at each outermost module call, of every module in its tree (the
  calls inside it keep PyTorch's fast path: `memlab.core.native.outer`), told once per
  storage: a storage the ledger follows keeps its lasting role there, so the caches here live
  as long as the process (those of a module called outside its tree, unseen, are named at the
  region's end where they are parameters an op read);
* saved tensors: the pack hook is a C function (`memlab.core.native.pack`; until it is built,
  the library's own op ``memlab::saved``, called without a Python frame), which logs the saving
  and returns an alias that logs when autograd lets it go;
* the optimizers stepped, named after each step and at the region's end; Hugging Face's
  key/value caches, named at each update (`memlab.core.kv_caches`).
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Callable
from typing import Any

import torch

from memlab.core import _torch, transforms
from memlab.core._torch_record import GlobalHooks, raw_op, storage_address, tensor_address, unseen
from memlab.core.categories import PRIORITY, STICKY, Category
from memlab.core.ledger import Ledger, storage_of
from memlab.core.native import pack
from memlab.core.native.objects import typed_tensors
from memlab.core.native.optimizers import name_optimizer
from memlab.core.native.outer import Outer
from memlab.core.native.watching import QuickWatch
from memlab.core.older_graphs import OWN_UNPACK
from memlab.core.older_graphs import unpack as _unpack
from memlab.core.recorder import Phase
from memlab.core.roles import Roles, module_tree

#: A category's code in the library: its priority + 1 (lower is stronger; 0 none).
CODE: dict[Category, int] = {c: p + 1 for c, p in PRIORITY.items()}
CATEGORY: dict[int, Category] = {code: c for c, code in CODE.items()}


_NOTHING: Callable[[], None] = lambda: None  # noqa: E731
#: The library's op memlab's native saved-tensor hook calls, once registered.
_PACK: list[Any] = []


def native_pack() -> Any:
    """The native regions' pack hook (None before the first): a dispatch-mode region nested
    in one knows it for memlab's own."""
    return _PACK[0] if _PACK else None


class NativeRoles(QuickWatch, Roles):
    """One per ledger and process (`roles_for`); installed for each native breakdown region."""

    def __init__(self, ledger: Ledger, lib: Any) -> None:
        self.ledger = ledger
        self.lib = lib
        self.errors: list[str] = []
        self._leaves = torch.utils.weak.WeakIdKeyDictionary()
        self._leaf_refs = {}
        self._grad_refs = {}
        self._marked = {}
        self._prune_at = 4096
        self._optimizers = weakref.WeakSet()  # (the base class's: `watch` of an optimizer)
        #: The optimizers stepped in the open region, held weakly (one dropped there is freed)
        self._stepped: list[weakref.ref[torch.optim.Optimizer]] = []
        #: Per optimizer: the identities of its parameters and state tensors when last named.
        self._named: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
        self._optimizer_depth = 0
        self.labelled = 0
        self._cell = ctypes.c_int.in_dll(lib, "mn_py_phase")
        self._pack: Any = None  # (the pair in force: in C, or the op's and `_unpack`)
        self._unpack: Any = _unpack
        self._op: Any = None
        self._pack_in = self._hooks_in = False  # (what `install` put in, for `uninstall`)
        self._open = False
        self._hooks = hooks = GlobalHooks(  # (the forward phase: while a module call is open)
            self._module_pre, self._module_post, self._optimizer_pre, self._optimizer_post
        )
        self._outer = Outer(self._set_phase, hooks.install_post, hooks.pause_pre, hooks.resume_pre)
        self._caches_out: Callable[[], None] = _NOTHING  # (`install` names the KV caches)

    # -- install / uninstall ------------------------------------------------------------------
    def install(self, saved: bool = True) -> None:
        """Hooks in (``saved``: the saved-tensor hook too, for a breakdown's activations); on
        any failure, what was done is undone and the error raised. (`errors` starts empty at
        the region's start, before its `first_look`.)"""
        self._prune()
        self._optimizer_depth = self.labelled = 0
        self._outer.reset()
        self._stepped.clear()
        self._set_phase()
        try:
            self._hooks_in = True
            self._hooks.install(post=False)  # (the outermost call's own hook: `Outer`)
            self._caches_out = self.kv_caches_in()
            if saved:
                self._push_pack()
        except BaseException:
            self.uninstall()
            raise
        self._open = True

    def _prune(self) -> None:
        """Drops the caches' entries for tensors and storages that died (models built again
        and again, as the what-if panel does), once they have grown."""
        if max(len(self._leaf_refs), len(self._grad_refs)) > self._prune_at:
            self._leaf_refs = {k: v for k, v in self._leaf_refs.items() if v[0]() is not None}
            self._grad_refs = {k: v for k, v in self._grad_refs.items() if v[0]() is not None}
            self._marked = {k: v for k, v in self._marked.items() if v() is not None}
            self._prune_at = 2 * max(len(self._leaf_refs), len(self._grad_refs)) + 4096

    def _push_pack(self) -> None:
        on = transforms.in_force()  # (memlab's stale pairs taken off)
        if on is not None:  # only the top pair applies: the program's own stay in force
            self.errors.append(
                "activations not tagged: the program's own saved_tensors_hooks are in force"
            )
            return
        # The hooks in C where the record follows ops at its dispatch key (which never sees
        # memlab::saved: a composite op, gone above the key); through RecordFunction, which
        # sees it read the saved tensor (as the dispatch mode sees its hook's detach()), the op.
        in_c = pack.hooks() if int(self.lib.mn_route()) == 1 else None  # (None until built)
        if in_c is not None:
            self._pack, self._unpack = in_c
            if not any(own is in_c[1] for own in OWN_UNPACK):
                OWN_UNPACK.append(in_c[1])
        else:
            if self._op is None:
                if int(self.lib.mn_saved_op()) != 0:
                    self.errors.append(
                        "activations not tagged: memlab's op could not be registered"
                    )
                    return
                self._op = raw_op(torch.ops.memlab.saved.default)
            self._pack, self._unpack = self._op, _unpack
        if not _PACK or _PACK[0] is not self._pack:
            _PACK[:] = [self._pack]
        try:
            _torch.push_saved_tensors_hooks(self._pack, self._unpack)
        except RuntimeError as e:  # saved-tensor hooks disabled by the program (e.g. FSDP)
            self.errors.append(f"activations not tagged: {e}")
            return
        self._pack_in = True
        transforms.install(self._pack, self._unpack, self._stepped_aside)

    def uninstall(self) -> None:
        """Takes out what `install` put in (each part once, whatever failed before it)."""
        self._open = False
        try:
            if self._pack_in:
                self._pack_in = False
                transforms.uninstall(self._pack)
                if not _torch.remove_saved_tensors_hooks(self._pack):
                    self.errors.append("memlab's saved_tensors_hooks were removed by other code")
        finally:
            try:
                if self._hooks_in:
                    self._hooks_in = False
                    self._hooks.remove()
            finally:
                try:
                    self._outer.close()
                finally:
                    self._cell.value = Phase.OTHER
                    out, self._caches_out = self._caches_out, _NOTHING
                    out()

    # -- the phase ------------------------------------------------------------------------------
    def _set_phase(self) -> None:
        if self._optimizer_depth:
            phase = Phase.OPTIMIZER
        elif self.labelled:
            phase = self.labelled
        elif self._outer.depth:
            phase = Phase.FORWARD
        else:
            phase = Phase.OTHER
        self._cell.value = phase

    def label(self, code: int) -> int:
        """Sets the front end's label (`memlab.track.phase`); returns the one it replaces."""
        outer, self.labelled = self.labelled, code
        self._set_phase()
        return outer

    # -- roles ---------------------------------------------------------------------------------
    def mark(self, t: torch.Tensor, category: Category) -> None:
        if (storage := storage_of(t)) is None:
            return
        sticky = category in STICKY
        key = (id(storage), category)
        if sticky:  # told once a process: the ledger keeps it, or the region hands it over
            told = self._marked.get(key)
            if told is not None and told() is storage:
                return
        if sticky and self.ledger.knows(storage):
            self.ledger.classify(t, category, storage)
            self.lib.mn_sticky(storage_address(storage), CODE[category])
        self.lib.mn_mark(storage_address(storage), CODE[category])
        if sticky:
            self._marked[key] = weakref.ref(storage)

    def _remember_leaf(self, t: torch.Tensor, storage: object = None) -> None:
        # per process: a parameter whose tensor and memory are the ones named before is done
        seen = self._leaf_refs.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t.data_ptr():
            return
        self._leaf_refs[id(t)] = (weakref.ref(t), t.data_ptr())
        if isinstance(t, torch.nn.Parameter):
            self.mark(t, Category.PARAMETER)

    def _module_pre(self, module: torch.nn.Module, args: Any) -> None:
        whole = self._outer.called(module)  # (the calls inside an outermost one go unseen)
        try:  # (the program's torch function modes, or a subclass's, see none of it)
            with unseen():
                if not whole:
                    self._name_module(module)
                    return
                for m in module_tree(module):  # its modules, named now
                    self._name_module(m)
        except Exception as e:  # never break the user's forward for our bookkeeping
            self._error(e, "a module's roles not read")

    def _name_module(self, module: torch.nn.Module) -> None:
        refs = self._leaf_refs
        for p in module._parameters.values():
            if p is not None:
                seen = refs.get(id(p))  # (`_remember_leaf`'s test, inline: per module)
                if seen is None or seen[0]() is not p or seen[1] != p.data_ptr():
                    self._remember_leaf(p)
        if module._buffers:
            for b in module._buffers.values():
                if b is not None:
                    self.mark(b, Category.BUFFER)

    def _module_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._outer.returned_any()  # (the global forward hook: where `Outer` put it in)

    def _optimizer_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_depth += 1
        self._set_phase()
        if not any(r() is opt for r in self._stepped):
            with contextlib.suppress(TypeError):  # (no weak reference: named after its step)
                self._stepped.append(weakref.ref(opt))
        self.lib.mn_mark_grads()  # the gradients it reads (it may free them: zero_grad)

    def _optimizer_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)
        self._set_phase()
        with unseen():  # named now (a first step's state is there), and at the end if alive
            name_optimizer(self, opt, self._named)

    def finish(self) -> None:
        """At the region's end (the record still held): the parameters among the leaves and
        the older tensors ops read (a frozen one, an EMA copy, a backward's leaves), and the
        optimizers' parameters and state. (Gradients are named by the library, at the end of
        each backward and of the region.)"""
        for t in typed_tensors(int(self.lib.mn_typed_count())):
            if isinstance(t, torch.nn.Parameter):
                self.mark(t, Category.PARAMETER)
            else:  # (not asked about again)
                self.lib.mn_plain(tensor_address(t))
        stepped = [o for o in (r() for r in self._stepped) if o is not None]
        self._stepped = []
        watched: list[torch.optim.Optimizer] = []
        if len(self._optimizers):  # (named once by `watch`; their state may be new)
            watched = list(self._optimizers)
            self._optimizers.clear()
        for opt in (*stepped, *(o for o in watched if not any(o is s for s in stepped))):
            name_optimizer(self, opt, self._named)

    def _error(self, e: Exception, what: str) -> None:
        if len(self.errors) < 5:
            try:
                said = f"{type(e).__name__}: {e}"
            except Exception:
                said = type(e).__name__
            self.errors.append(f"{what} ({said})")


def roles_for(ledger: Ledger, lib: Any) -> NativeRoles:
    """The ledger's roles (their caches last as long as the ledger: see `NativeRoles.mark`),
    kept on the ledger itself (a cycle the garbage collector frees with it)."""
    roles: NativeRoles | None = ledger.native_roles
    if roles is None or roles.lib is not lib:
        roles = ledger.native_roles = NativeRoles(ledger, lib)
    return roles
