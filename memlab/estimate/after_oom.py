"""An out-of-memory met on a GPU, explained from the caching allocator's state at that moment.

``%%gpumem`` calls `after_oom` when a cell raises ``torch.OutOfMemoryError`` (before the user's
traceback is shown); a ``memlab.track`` or what-if user may call it in their own ``except``. The
cache comes from ``torch.cuda.memory_snapshot()``; what was live, by category and by variable,
from memlab's tensor accounting where it ran on that device (``%%gpumem -b``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Container
from typing import Any

from memlab.core import cuda
from memlab.core.categories import Category
from memlab.core.frames import users_traceback
from memlab.core.ledger import Ledger, default_ledger
from memlab.estimate.allocator import round_size
from memlab.estimate.holders import variable_names, variable_root
from memlab.estimate.oom import explain, state_levers
from memlab.reports.oom import LiveTensor, OOMExplanation

_TRIED = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def requested_of(error: BaseException) -> int | None:
    """The bytes PyTorch's message says it tried to allocate (to its two decimals)."""
    m = _TRIED.search(str(error))
    return None if m is None else round_size(int(float(m.group(1)) * _UNITS[m.group(2)]))


@users_traceback()
def after_oom(
    error: BaseException,
    device: str = "cuda:0",
    *,
    ledger: Ledger | None = None,
    namespace: dict[str, Any] | None = None,
    hidden: Container[str] = (),
    state: tuple[list[dict[str, Any]], int] | None = None,
) -> OOMExplanation | None:
    """Explain ``error`` (a ``torch.OutOfMemoryError``) on ``device``: the cache, what was
    live, the levers. ``state``: the allocator's (segments, bytes it may reserve), read from the
    device when not given; None is returned when there is none to read (no CUDA)."""
    if not isinstance(error, BaseException):
        raise TypeError(
            f"after_oom: error is a {type(error).__name__}: pass the exception the code raised "
            "(a torch.OutOfMemoryError, caught with except torch.OutOfMemoryError as e)."
        )
    if not isinstance(device, str):
        raise TypeError(
            f"after_oom: device is a {type(device).__name__}: pass the device as a str, "
            "such as 'cuda:0'."
        )
    index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
    if state is None:
        state = cuda.cache_state(index)
        if state is None:
            return None
    segments, capacity = state
    ledger = ledger if ledger is not None else default_ledger()
    names = variable_names(ledger, namespace or {}, hidden)
    live = []
    for entry in ledger.entries(device):
        if entry.category is not None:
            role = str(entry.category)
        else:
            role = str(Category.ACTIVATION if entry.saved else Category.OTHER)
        live.append(LiveTensor(entry.nbytes, role, tuple(names.get(entry.serial, ()))))
    requested = requested_of(error) or 0
    probe = explain(
        where=device, requested=requested, capacity=capacity, segments=segments, live=live
    )
    held: dict[str, int] = {}
    for t in live:
        if t.category == str(Category.OTHER):
            for name in t.names:
                root = variable_root(name)
                held[root] = held.get(root, 0) + t.nbytes
    notes = [
        "levers predicted from the allocator's state at the failure: a later moment of the step "
        "may need more",
    ]
    if not live:
        notes.append("no tensor accounting on this device: run the cell with %%gpumem -b")
    activations = dict(probe.by_category).get(str(Category.ACTIVATION), 0)
    levers = state_levers(probe, activations, held)
    return dataclasses.replace(probe, levers=tuple(levers), notes=tuple(notes))
