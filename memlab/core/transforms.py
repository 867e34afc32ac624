"""memlab's saved-tensor hooks step aside for code that refuses to run under any.

``torch.func.grad``, ``vjp``, ``jacrev`` and ``hessian`` (and ``vmap`` on older PyTorch, which
transformers 4 builds its attention masks with) enter ``torch.autograd.graph.
disable_saved_tensors_hooks``, which raises where a pair of hooks is in force. A breakdown keeps
memlab's pair in force for its whole region, so the program's own call raised inside it.

While a breakdown region is open, that context manager is memlab's `StepAside`: where the pair
in force is memlab's, it is taken off for the block's length and put back after (what autograd
saves inside the block is not tagged as saved; the region's notes say so). Where another pair
is in force, PyTorch's own error is raised, as without memlab. Where PyTorch cannot say which
pair is in force (2.4), the pairs pushed through its Python call while such a region is open
are followed on each thread, so that memlab's own is told apart (a pair pushed from C++ alone
would not be). What was replaced is put back when the last such region closes, unless other
code replaced it meanwhile.

A region opening looks at the pair in force through `in_force`, which first takes off memlab's
own pairs that no region open on the thread holds (see there).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

from memlab.core import _torch
from memlab.core._torch_record import saved_hooks_module

#: The pack hooks of memlab's pairs in force, each with what to call when it steps aside and
#: the thread it was pushed on.
_OURS: list[tuple[Any, Callable[[], None], int]] = []
_lock = threading.Lock()
_original: list[Any] = []
_C: Any = saved_hooks_module()
#: PyTorch's push and pop of a pair, where memlab follows them (PyTorch 2.4); a generation
#: count, so that a thread's pairs from an earlier such time are not taken for today's.
_followed: list[Any] = []
_generation = [0]
_pushed = threading.local()


def _pairs() -> list[tuple[Any, Any]]:
    """The pairs pushed on this thread (through Python) since memlab began to follow them."""
    if getattr(_pushed, "generation", None) != _generation[0]:
        _pushed.generation, _pushed.pairs = _generation[0], []
    pairs: list[tuple[Any, Any]] = _pushed.pairs
    return pairs


def _push(pack: Any, unpack: Any) -> None:
    _followed[0](pack, unpack)
    _pairs().append((pack, unpack))


def _pop() -> None:
    _followed[1]()
    pairs = _pairs()
    if pairs:
        pairs.pop()


def _in_force() -> tuple[Any, Any] | None:
    if _followed:  # PyTorch cannot say: the last pair pushed on this thread, if any
        pairs = _pairs()
        return pairs[-1] if pairs else None
    return _torch.saved_tensors_hooks_on()


class StepAside:
    """``disable_saved_tensors_hooks(error_message)``, with memlab's pair taken off first."""

    def __init__(self, error_message: str) -> None:
        inner = _original[0] if _original else torch.autograd.graph.disable_saved_tensors_hooks
        self._inner = None if inner is StepAside else inner(error_message)
        self._lifted: list[tuple[Any, Any]] = []

    def __enter__(self) -> None:
        # memlab's pairs on top (a region nested in another has one each), all of them
        while (top := _in_force()) is not None and (told := _told(top[0])) is not None:
            _C._pop_saved_tensors_default_hooks()
            self._lifted.append(top)
            told()
        try:
            if self._inner is not None:
                self._inner.__enter__()
        except BaseException:
            self._put_back()
            raise

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool:
        try:
            return bool(self._inner.__exit__(et, ev, tb)) if self._inner is not None else False
        finally:
            self._put_back()

    def _put_back(self) -> None:
        while self._lifted:
            _torch.push_saved_tensors_hooks(*self._lifted.pop())


def _told(pack: Any) -> Callable[[], None] | None:
    with _lock:
        for ours, told, _ in _OURS:
            if ours == pack:
                return told
    return None


#: memlab's unpack hooks: the CUDA log's, and the list of the others (`older_graphs`).
_UNPACKS: list[Any] = []


def in_force() -> tuple[Any, Any] | None:
    """The pair in force on this thread (`_torch.saved_tensors_hooks_on`), once memlab's own
    pairs on top that no region open on this thread holds are taken off. Such a stale pair is
    left by a region closed inside backward (the autograd engine puts back the thread's state it
    saved, the pair with it), by one closed on another thread, or by a Ctrl-C just after a push:
    a region opening under it would take it for memlab's region around this one (and a CUDA
    log, the graph built in it for one a ledger follows, which no later region walks) or for
    the program's own pair (and tag nothing)."""
    if not _UNPACKS:  # (imported here: they import this module)
        from memlab.core.cuda_names import log_unpack
        from memlab.core.older_graphs import OWN_UNPACK

        _UNPACKS[:] = [log_unpack, OWN_UNPACK]
    log_unpack, own_unpacks = _UNPACKS
    me = threading.get_ident()
    while (on := _torch.saved_tensors_hooks_on()) is not None:
        ours = on[1] is log_unpack or any(on[1] is own for own in own_unpacks)
        with _lock:
            if not ours or any(p == on[0] and t == me for p, _, t in _OURS):
                return on
        _C._pop_saved_tensors_default_hooks()
    return None


def install(pack: Any, unpack: Any, told: Callable[[], None]) -> None:
    """memlab's pair (``pack``, ``unpack``), just pushed on this thread, is in force:
    ``told()`` is called each time it steps aside."""
    graph: Any = torch.autograd.graph  # (its attribute is replaced, so not typed as itself)
    with _lock:
        if not _OURS and graph.disable_saved_tensors_hooks is not StepAside:
            _original[:] = [graph.disable_saved_tensors_hooks]
            graph.disable_saved_tensors_hooks = StepAside
        if not _OURS and _torch._top_hooks is None and not _followed:  # (PyTorch 2.4)
            _followed[:] = [
                _C._push_saved_tensors_default_hooks,
                _C._pop_saved_tensors_default_hooks,
            ]
            _generation[0] += 1
            _C._push_saved_tensors_default_hooks = _push
            _C._pop_saved_tensors_default_hooks = _pop
        _OURS.append((pack, told, threading.get_ident()))
    pairs = _pairs() if _followed else None
    if pairs is not None and (not pairs or pairs[-1][0] != pack):  # (not followed when pushed)
        pairs.append((pack, unpack))


def uninstall(pack: Any) -> None:
    """memlab's pair with pack hook ``pack`` is out of force; the last one out puts PyTorch's
    context manager back (where it is still memlab's)."""
    graph: Any = torch.autograd.graph  # (its attribute is replaced, so not typed as itself)
    with _lock:
        for i, (ours, _, _) in enumerate(_OURS):
            if ours == pack:
                del _OURS[i]
                break
        if not _OURS and _original:
            if graph.disable_saved_tensors_hooks is StepAside:
                graph.disable_saved_tensors_hooks = _original[0]
            _original.clear()
        if not _OURS and _followed:
            if _C._push_saved_tensors_default_hooks is _push:
                _C._push_saved_tensors_default_hooks = _followed[0]
            if _C._pop_saved_tensors_default_hooks is _pop:
                _C._pop_saved_tensors_default_hooks = _followed[1]
            _followed.clear()


NOTE = (
    "what autograd saved inside torch.func transforms (or other code that refuses "
    "saved-tensor hooks) is not tagged as saved"
)
