"""memlab's saved-tensor hooks step aside for code that refuses to run under any.

``torch.func.grad``, ``vjp``, ``jacrev`` and ``hessian`` (and ``vmap`` on older PyTorch, which
transformers 4 builds its attention masks with) enter ``torch.autograd.graph.
disable_saved_tensors_hooks``, which raises where a pair of hooks is in force. A breakdown keeps
memlab's pair in force for its whole region, so the program's own call raised inside it.

While a breakdown region is open, that context manager is memlab's `StepAside`: where the pair
in force is memlab's, it is taken off for the block's length and put back after (what autograd
saves inside the block is not tagged as saved; the region's notes say so). Where another pair
is in force, or PyTorch cannot say which pair is (before 2.5), PyTorch's own error is raised,
as without memlab. The original is put back when the last such region closes, unless other
code replaced it meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

from memlab.core import _torch

#: The pack hooks of memlab's pairs in force, each with what to call when it steps aside.
_OURS: list[tuple[Any, Callable[[], None]]] = []
_lock = threading.Lock()
_original: list[Any] = []


class StepAside:
    """``disable_saved_tensors_hooks(error_message)``, with memlab's pair taken off first."""

    def __init__(self, error_message: str) -> None:
        inner = _original[0] if _original else torch.autograd.graph.disable_saved_tensors_hooks
        self._inner = None if inner is StepAside else inner(error_message)
        self._lifted: tuple[Any, Any] | None = None

    def __enter__(self) -> None:
        top = _torch.saved_tensors_hooks_on()
        told = _told(top[0]) if top is not None else None
        if told is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._lifted = top
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
        if self._lifted is not None:
            _torch.push_saved_tensors_hooks(*self._lifted)
            self._lifted = None


def _told(pack: Any) -> Callable[[], None] | None:
    with _lock:
        for ours, told in _OURS:
            if ours == pack:
                return told
    return None


def install(pack: Any, told: Callable[[], None]) -> None:
    """memlab's pair with pack hook ``pack`` is in force: ``told()`` is called each time it
    steps aside."""
    graph: Any = torch.autograd.graph  # (its attribute is replaced, so not typed as itself)
    with _lock:
        if not _OURS and graph.disable_saved_tensors_hooks is not StepAside:
            _original[:] = [graph.disable_saved_tensors_hooks]
            graph.disable_saved_tensors_hooks = StepAside
        _OURS.append((pack, told))


def uninstall(pack: Any) -> None:
    """memlab's pair with pack hook ``pack`` is out of force; the last one out puts PyTorch's
    context manager back (where it is still memlab's)."""
    graph: Any = torch.autograd.graph  # (its attribute is replaced, so not typed as itself)
    with _lock:
        for i, (ours, _) in enumerate(_OURS):
            if ours == pack:
                del _OURS[i]
                break
        if not _OURS and _original:
            if graph.disable_saved_tensors_hooks is StepAside:
                graph.disable_saved_tensors_hooks = _original[0]
            _original.clear()


NOTE = (
    "what autograd saved inside torch.func transforms (or other code that refuses "
    "saved-tensor hooks) is not tagged as saved"
)
