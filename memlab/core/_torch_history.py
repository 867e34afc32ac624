"""The seam between memlab and the CUDA caching allocator's history (its event log), which
`memlab.core.cuda_log` reads: whether it is on, starting it as the log wants it, and noticing the
program setting it itself. Private PyTorch names live here (see `memlab.core._torch`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from memlab.core._torch import PATCH_LOCK


def cuda_history_on() -> bool | None:
    """Whether the CUDA caching allocator records its history now (None where this PyTorch
    cannot say). Checked 2.4.1, 2.11."""
    said = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return bool(said()) if callable(said) else None


def start_cuda_log(max_entries: int) -> None:
    """The allocator's history without stack frames, only its ``alloc`` and ``free_requested``
    where this PyTorch can leave the other actions out (2.11: a smaller log to read back)."""
    record = torch.cuda.memory._record_memory_history
    try:
        record(context=None, max_entries=max_entries, clear_history=True, skip_actions=_SKIP)
    except (TypeError, ValueError, RuntimeError):  # 2.4: neither argument; an action renamed
        record(context=None, max_entries=max_entries)


_SKIP = ["free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap"]


def watch_history(called: Callable[[], None]) -> Callable[[], None]:
    """Calls ``called`` whenever the program sets the allocator's history while watched (through
    ``torch.cuda.memory._record_memory_history``, as a program dumping its own snapshot does);
    returns what stops watching (it puts the function back if nothing replaced it since).
    Checked 2.4.1, 2.11."""
    memory = torch.cuda.memory
    original = memory._record_memory_history
    # (emptied when put back: a wrapper that other code keeps in place holds nothing of ours)
    told = [called]

    @functools.wraps(original)
    def record_memory_history(*args: Any, **kwargs: Any) -> Any:
        done = original(*args, **kwargs)  # (a call that raises set nothing)
        for tell in told:
            tell()
        return done

    def put_back() -> None:
        told.clear()
        with PATCH_LOCK:
            if memory._record_memory_history is record_memory_history:
                memory._record_memory_history = original

    with PATCH_LOCK:  # (set for the whole region, so not through `patched`, which holds it)
        memory._record_memory_history = record_memory_history
    return put_back
