"""Paying PyTorch's one-time costs outside every measured region."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import torch

from memlab.core._torch import TorchDispatchMode


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return func(*args, **(kwargs or {}))


_thread: threading.Thread | None = None
_warm = False  # (the warm-up thread has ended)


#: How long the warm-up waits for another thread's import of torch._dynamo to finish.
WAIT_FOR_IMPORT = 120.0
#: The recursion limit the import is given where the program's is lower (Python's default).
IMPORT_DEPTH = 1000


def _imported_elsewhere() -> bool:
    """Whether a thread (the user's: building an optimizer, a panel's run) is importing
    torch._dynamo right now: its module exists, half initialised."""
    module = sys.modules.get("torch._dynamo")
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _first_mode() -> None:
    # Two threads importing torch._dynamo at once can each find the other's half-made module
    # (PyTorch's imports are circular): the one that loses gets an ImportError, and
    # torch.compile stays broken for the process. So an import under way elsewhere is waited
    # for, never joined.
    deadline = time.monotonic() + WAIT_FOR_IMPORT
    while _imported_elsewhere() and time.monotonic() < deadline:
        time.sleep(0.01)
    # The import nests deeply: under a program's low recursion limit (200) it would fail, here
    # and then inside the user's cell. Python's default is lent for it (the caller waits).
    limit = sys.getrecursionlimit()
    if limit < IMPORT_DEPTH:
        sys.setrecursionlimit(IMPORT_DEPTH)
    try:
        with _PassThrough():
            torch.empty(0)
        # the first optimizer imports it too (on older PyTorch, where a dispatch mode does not)
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    except Exception:  # (left to the first region, which says what went wrong)
        pass
    finally:
        if limit < IMPORT_DEPTH and sys.getrecursionlimit() == IMPORT_DEPTH:
            sys.setrecursionlimit(limit)


def warm_up() -> None:
    """The first op under any dispatch mode, or the first optimizer, makes torch import
    torch._dynamo (~2 s, once per process). Pay that here, outside every measured region,
    instead of inside the first one.

    The import leaves the frames that were on the stack in a reference cycle (torch.fx keeps the
    frame that imports it), and a frame keeps its function's locals until Python's collector
    runs: a model built later in the same function would stay alive after it returns. So the
    import runs on a thread of its own, whose stack holds nothing of the caller's."""
    global _thread, _warm
    if _warm:  # (every region asks)
        return
    if _thread is None:  # one thread, ever: a Ctrl-C while waiting leaves it to finish alone
        _thread = threading.Thread(target=_first_mode, name="memlab-warm-up", daemon=True)
        _thread.start()
    _thread.join()
    _warm = True
