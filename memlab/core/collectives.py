"""Which dispatched ops are collectives, whose tensors are communication buffers.

``torch.distributed``'s collectives reach the dispatcher as ops of the ``c10d`` namespace
(``allreduce_``, ``_allgather_base_``, ``_reduce_scatter_base_``, ...), through which DDP's
gradient buckets and FSDP's flat all-gather and reduce-scatter buffers pass. Every tensor such an
op reads or writes is marked ``communication``; a storage that is also a parameter or gradient
(DDP's buckets with ``gradient_as_bucket_view=True``, FSDP's reduce-scatter output that becomes
the sharded gradient) keeps that higher-priority role. The functional collectives
(``_c10d_functional``, which DTensor's redistributions and tensor parallelism use) are left out:
their tensors are the program's own activations and results, which keep their roles.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from memlab.core.categories import Category
from memlab.core.ledger import Ledger
from memlab.core.storages import storage_of

#: Op namespaces of the collectives whose tensors are buffers (checked 2.4.1, 2.13).
NAMESPACES = frozenset({"c10d"})
#: Ops that only wait or name a group: their tensors are not new buffers.
SKIPPED = frozenset({"wait_tensor", "barrier", "monitored_barrier_"})

_known: dict[Any, bool] = {}


def is_collective(func: Any) -> bool:
    """Whether the dispatched op ``func`` (an ``OpOverload``) is a collective; one dict look-up
    per op once each op was seen."""
    known = _known.get(func)
    if known is None:
        name = str(getattr(func, "name", lambda: "")())
        namespace, _, rest = name.partition("::")
        known = _known[func] = namespace in NAMESPACES and rest.split(".")[0] not in SKIPPED
    return known


def buffers(args: Any, kwargs: Any, out: Any) -> list[torch.Tensor]:
    """The tensors among a collective's arguments and results, however nested (``allgather_``
    takes a list of lists)."""
    found: list[torch.Tensor] = []
    stack: list[Any] = [args, list(kwargs.values()) if kwargs else [], out]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return found


class Collectives:
    """One region's collectives: marks their tensors, and adopts the staging buffer a backend
    made inside a collective where no dispatch mode sees it (gloo reduce-scatters a flat copy
    of the input and splits it when the work is waited on: the next op or two). A storage new
    to the ledger, the size of a reduce-scatter's input, read by one of the next `WINDOW` ops,
    is counted as allocated there (communication), not as memory from before the region."""

    WINDOW = 3

    def __init__(self, ledger: Ledger, error: Callable[[Exception], None]) -> None:
        self.ledger = ledger
        self.error = error
        #: Input sizes (bytes) of the last collective, while its window is open.
        self.pending: list[int] = []
        self._left = 0

    def seen(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        try:
            tensors = buffers(args, kwargs, out)
            for t in tensors:
                self.ledger.classify(t, Category.COMMUNICATION)
            if "reduce_scatter" in str(func):  # the only collective seen to stage (gloo)
                self.pending = [t.numel() * t.element_size() for t in buffers(args, None, None)]
                self._left = self.WINDOW
        except Exception as e:  # never break the user's collective for our bookkeeping
            self.error(e)

    def adopt(self, args: Any, kwargs: Any) -> None:
        try:
            self._left -= 1
            for t in buffers(args, kwargs, None):
                st = storage_of(t)
                if st is not None and not self.ledger.knows(st) and st.nbytes() in self.pending:
                    self.pending.remove(st.nbytes())
                    self.ledger.produced(t, st, time.perf_counter())
                    self.ledger.classify(t, Category.COMMUNICATION)
            if self._left <= 0:
                self.pending = []
        except Exception as e:
            self.pending = []
            self.error(e)
