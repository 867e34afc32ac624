"""When a native region's forward phase ends: the outermost module call's own forward hook.

The forward phase lasts while a module call is open. A global forward hook would say when each
call returns, at the cost of PyTorch's slow path for every module call (about 1 µs each on the
project's 2-core CPU machine, torch 2.13). Here the global pre-hook (`NativeRoles._module_pre`)
tells `Outer` of each call; the outermost one, where it has no forward hook of its own, gets
one for the call (always called, so also where its forward raises), which ends the phase and
takes itself out. Where the module has forward hooks of its own (they would run after a global
one, so the phase must end before them), or does not keep PyTorch's hook dicts, the global
forward hook is put in for the rest of the region and every call is counted, as before.

While the outermost call runs, its module carries the hook: a deep copy made then carries a
hook that does nothing (`_Ended`), and a pickle of it names `inert` in this module.
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


class Outer:
    """The open module calls of one region (`depth`: of the outermost module where its own
    hook is in, else of every module)."""

    def __init__(self, changed: Callable[[], None], global_post: Callable[[], None]) -> None:
        self._changed = changed  # the phase may have changed
        self._global_post = global_post  # puts the global forward hook in
        self.depth = 0
        self.counts_all = False  # the global forward hook is in: every call counts
        self._top: torch.nn.Module | None = None
        self._stale: torch.nn.Module | None = None  # (still carries the hook: see `_returned`)
        self._id = RemovableHandle(OrderedDict()).id  # (an id no other hook has)
        self._hook = _Ended(self)

    def reset(self) -> None:
        """A region opens: no call open, no hook anywhere."""
        self.depth = 0
        self.counts_all = False
        self._top = self._stale = None

    def called(self, module: torch.nn.Module) -> None:
        """The global pre-hook saw ``module`` called."""
        if self.counts_all:
            self.depth += 1
            if self.depth == 1:
                self._changed()
        elif self._top is None:
            self._enter(module)
        elif module is self._top:  # (called again inside itself)
            self.depth += 1
        elif self._id not in self._top.__dict__.get(_DICTS[0], ()):
            # the outermost call's hooks were replaced under it: it ended unseen (at the latest
            # here), and this call is the outermost now
            self._top = None
            self._enter(module)

    def returned_any(self) -> None:
        """The global forward hook (where it is in) saw a call return."""
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            self._changed()

    def close(self) -> None:
        """The region ends: the hook is taken off the module that still has it."""
        try:
            for module in (self._top, self._stale):
                if module is not None:
                    self._detach(module)
        finally:
            self._top = self._stale = None
            self.depth = 0

    def _enter(self, module: torch.nn.Module) -> None:
        stale, self._stale = self._stale, None
        if stale is not None and stale is not module:
            self._detach(stale)
        if stale is module or self._attach(module):
            self._top = module
        else:
            self._global_post()
            self.counts_all = True
        self.depth = 1
        self._changed()

    def _attach(self, module: torch.nn.Module) -> bool:
        found = module.__dict__
        hooks, always = found.get(_DICTS[0]), found.get(_DICTS[1])
        if type(hooks) is not OrderedDict or type(always) is not OrderedDict or hooks:
            return False
        hooks[self._id] = self._hook
        always[self._id] = True
        return True

    def _detach(self, module: torch.nn.Module) -> None:
        found = module.__dict__
        for name in _DICTS:
            hooks = found.get(name)
            if hooks is not None:
                hooks.pop(self._id, None)

    def returned(self, module: torch.nn.Module) -> None:
        """The outermost call's own hook ran: its module returned (or raised)."""
        if module is not self._top:
            return
        self.depth -= 1
        if self.depth > 0:
            return
        self.depth = 0
        self._top = None
        # Taken off now where that is safe: PyTorch runs a copy of the hooks' list once the
        # forward returned; where it raised, PyTorch iterates the dict itself, which may lose
        # its only key (ours, unless a hook was added during the forward) and no other.
        hooks = module.__dict__.get(_DICTS[0])
        if sys.exc_info()[0] is None or (hooks is not None and len(hooks) == 1):
            self._detach(module)
        else:  # (taken off at the next outermost call, or at the region's end)
            self._stale = module
        self._changed()


def inert(*args: Any) -> None:
    """What a pickle of a module taken during its outermost call loads as our hook."""


class _Ended:
    """The outermost call's forward hook. A deep copy or a pickle of the module taken while it
    runs gets one that does nothing (`inert`): never `Outer`, its roles or the ledger."""

    __slots__ = ("_outer",)

    def __init__(self, outer: Outer) -> None:
        self._outer = weakref.ref(outer)

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        outer = self._outer()
        if outer is not None:
            outer.returned(module)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return inert

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert, ())


def _inert() -> Any:
    return inert
