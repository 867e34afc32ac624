"""When a native region's forward phase ends: the outermost module call's own forward hook.

The forward phase lasts while a module call is open. A global forward hook would say when each
call returns, at the cost of PyTorch's slow path for every module call (about 1 µs each on the
project's 2-core CPU machine, torch 2.13). Here the global pre-hook (`NativeRoles._module_pre`)
tells `Outer` of each call; the outermost one, where it has no forward hook of its own, gets
one for the call (always called, so also where its forward raises), which ends the phase and
takes itself out. Where the module has forward hooks of its own (they would run after a global
one, so the phase must end before them), or does not keep PyTorch's hook dicts, the global
forward hook is put in for the rest of the region and every call is counted, as before.

While the outermost call runs, the global pre-hook is out too (`pause`), so that every call
inside it keeps PyTorch's fast path; the outermost module gets a pre-hook of its own, which
counts it called again inside itself, and the global one is back when it returns (`resume`).
Its forward hook is held by the module alone: where the program takes it off during the call
(a hook dict cleared or replaced), the hook dies, and the global pre-hook is put back at once,
so that the calls after it are seen (and the first of them ends the call that was not).

While the outermost call runs, its module carries the hooks: a deep copy made then carries
hooks that do nothing (`inert`), and a pickle of it names `inert` in this module.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

_DICTS = ("_forward_hooks", "_forward_hooks_always_called")
_PRE = "_forward_pre_hooks"


def _no_pause() -> bool:
    return False


def _nothing() -> None:
    pass


class Outer:
    """The open module calls of one region (`depth`: of the outermost module where its own
    hook is in, else of every module)."""

    def __init__(
        self,
        changed: Callable[[], None],
        global_post: Callable[[], None],
        pause: Callable[[], bool] = _no_pause,
        resume: Callable[[], None] = _nothing,
    ) -> None:
        self._changed = changed  # the phase may have changed
        self._global_post = global_post  # puts the global forward hook in
        self._pause, self._resume = pause, resume  # the global pre-hook out, and back
        self.depth = 0
        self.counts_all = False  # the global forward hook is in: every call counts
        self._top: torch.nn.Module | None = None
        self._stale: torch.nn.Module | None = None  # (still carries the hook: see `_returned`)
        self._id = RemovableHandle(OrderedDict()).id  # (an id no other hook has)
        self._pre_id = RemovableHandle(OrderedDict()).id
        self._me = weakref.ref(self)
        #: The number of the open outermost call's hooks (0: none open); a hook of an older
        #: call does nothing.
        self.serial = 0
        self._serials = 0

    def reset(self) -> None:
        """A region opens: no call open, no hook anywhere."""
        self.depth = 0
        self.counts_all = False
        self._top = self._stale = None
        self.serial = 0

    def called(self, module: torch.nn.Module) -> bool:
        """The global pre-hook saw ``module`` called; True where it is the outermost call and
        the global pre-hook is out until it returns (the calls inside it go unseen)."""
        if self.counts_all:
            self.depth += 1
            if self.depth == 1:
                self._changed()
            return False
        top = self._top
        if top is not None and self._id not in top.__dict__.get(_DICTS[0], ()):
            # the outermost call's hook was taken off under it: it ended unseen (at the latest
            # here), and this call is the outermost now
            self._top = None
            self.serial = 0
            self._detach(top)
            top = None
        if top is None:
            return self._enter(module)
        return False  # (inside the outermost call: its own pre-hook counts it called again)

    def again(self, module: torch.nn.Module, serial: int) -> None:
        """The outermost module's own pre-hook: called again inside itself."""
        if serial == self.serial and module is self._top and self.depth:
            self.depth += 1

    def lost(self, serial: int) -> None:
        """The outermost call's forward hook died before it ran (taken off by the program): the
        global pre-hook is back, and the rest of ours is taken off the module (the call is
        taken for ended at the next module call, as where the global hook saw it all along)."""
        if serial == self.serial:
            self.serial = 0
            if self._top is not None:
                self._detach(self._top)  # (the dicts PyTorch only looks keys up in, or copies)
            self._resume()

    def returned_any(self) -> None:
        """The global forward hook (where it is in) saw a call return."""
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            self._changed()

    def close(self) -> None:
        """The region ends: the hook is taken off the module that still has it."""
        self.serial = 0  # (first: a hook dying below does nothing)
        try:
            for module in (self._top, self._stale):
                if module is not None:
                    self._detach(module)
        finally:
            self._top = self._stale = None
            self.depth = 0

    def _enter(self, module: torch.nn.Module) -> bool:
        stale, self._stale = self._stale, None
        if stale is not None:  # (its own hooks are not running: this call has not begun)
            self._detach(stale)
        paused = False
        if self._attach(module):
            self._top = module
            paused = self._pause()
        else:
            self._global_post()
            self.counts_all = True
        self.depth = 1
        self._changed()
        return paused

    def _attach(self, module: torch.nn.Module) -> bool:
        found = module.__dict__
        hooks, always, pre = found.get(_DICTS[0]), found.get(_DICTS[1]), found.get(_PRE)
        if type(hooks) is not OrderedDict or type(always) is not OrderedDict or hooks:
            return False
        if type(pre) is not OrderedDict:
            return False
        self._serials += 1
        self.serial = serial = self._serials
        # (this call's pre-hooks were listed before the global one ran: the new one is not
        # among them, and counts only the calls inside this one)
        pre[self._pre_id] = _Again(self._me, serial)
        hooks[self._id] = _Ended(self._me, serial)  # (the dict holds the only reference)
        always[self._id] = True
        return True

    def _detach(self, module: torch.nn.Module) -> None:
        found = module.__dict__
        for name in _DICTS:
            hooks = found.get(name)
            if hooks is not None:
                hooks.pop(self._id, None)
        self._detach_pre(module)

    def _detach_pre(self, module: torch.nn.Module) -> None:
        pre = module.__dict__.get(_PRE)
        if pre is not None:
            pre.pop(self._pre_id, None)

    def returned(self, module: torch.nn.Module, serial: int) -> None:
        """The outermost call's own hook ran: its module returned (or raised)."""
        if module is not self._top or serial != self.serial:
            return
        self.depth -= 1
        if self.depth > 0:
            return
        self.depth = 0
        self._top = None
        self.serial = 0
        # Taken off now where that is safe: PyTorch runs a copy of the hooks' list once the
        # forward returned; where it raised, PyTorch iterates the dict itself, which may lose
        # its only key (ours, unless a hook was added during the forward) and no other.
        hooks = module.__dict__.get(_DICTS[0])
        if sys.exc_info()[0] is None or (hooks is not None and len(hooks) == 1):
            self._detach(module)
        else:  # (taken off at the next outermost call, or at the region's end)
            self._detach_pre(module)
            self._stale = module
        self._resume()
        self._changed()


def inert(*args: Any) -> None:
    """What a pickle of a module taken during its outermost call loads as our hooks."""


class _Hook:
    """One of the outermost call's hooks. A deep copy or a pickle of the module taken while it
    runs gets one that does nothing (`inert`): never `Outer`, its roles or the ledger."""

    __slots__ = ("_outer", "_serial")

    def __init__(self, outer: weakref.ref[Outer], serial: int) -> None:
        self._outer = outer
        self._serial = serial

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return inert

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert, ())


class _Ended(_Hook):
    """The outermost call's forward hook: the call returned or raised."""

    __slots__ = ()

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        outer = self._outer()
        if outer is not None:
            outer.returned(module, self._serial)

    def __del__(self) -> None:
        # (the module's hook dict held it alone: dead before its call ran, it was taken off)
        try:
            outer = self._outer()
            if outer is not None:
                outer.lost(self._serial)
        except Exception:  # (at the interpreter's exit; never raise from here)
            pass


class _Again(_Hook):
    """The outermost module's own pre-hook, while the global one is out: called again."""

    __slots__ = ()

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        outer = self._outer()
        if outer is not None:
            outer.again(module, self._serial)


def _inert() -> Any:
    return inert
