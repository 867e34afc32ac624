"""Who reads the CUDA allocator's log (`memlab.core.cuda_log`): one region at a time, claimed
under a lock, and never where the program records the allocator's history itself."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import torch

from memlab.core._torch_history import cuda_history_on

ENV = "MEMLAB_CUDA_LOG"
_lock = threading.Lock()
#: The log open now, if any (the allocator has one history, process-wide).
_OPEN: list[Any] = []


def why_not() -> str | None:
    """None where a region can read the allocator's log now, else why not."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{ENV}=0"
    if not torch.cuda.is_initialized():
        return "CUDA is not initialised yet"
    backend = getattr(torch.cuda, "get_allocator_backend", None)
    name = backend() if callable(backend) else "native"
    if name != "native":  # (cudaMallocAsync and pluggable allocators keep no such log)
        return f"the {name} allocator keeps no history of its own"
    on = cuda_history_on()
    if on is None:
        return "this PyTorch cannot say whether the allocator records its history"
    if on:
        return "the program records the allocator's history itself"
    if _OPEN:
        return "another region reads the allocator's log"
    return None


def claim(log: Any) -> bool:
    """Claims the log for ``log``'s region; False where it cannot be read now (`why_not`)."""
    with _lock:
        if why_not() is not None:
            return False
        _OPEN.append(log)
        return True


def release(log: Any) -> None:
    with _lock:
        if log in _OPEN:
            _OPEN.remove(log)


def _in_child() -> None:
    # a forked child inherits the open region's hooks (nobody reads what they would name) and,
    # where another thread held it at the fork, a lock held for good
    global _lock
    _lock = threading.Lock()
    for log in list(_OPEN):
        with contextlib.suppress(Exception):
            log.forked()
    _OPEN.clear()


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_in_child)
