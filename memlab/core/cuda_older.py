"""What graphs from before a CUDA log's region hold saved (`memlab.core.cuda_log`).

A forward run in one cell and its backward in the next: the graph the first built holds its
activations saved, and the second frees them. `memlab.core.older_graphs` walks such a graph
once, without running its hooks; here its blocks' addresses are read at the region's start
(activations until freed) and again at its end (those no longer saved, though still alive,
count as saved no more). The objects the notebook's watch hands out are registered in the
ledger on the way, as the dispatch mode's watch does: the watch hands each new one out once.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memlab.core import older_graphs
from memlab.core.ledger import default_ledger
from memlab.core.storages import storage_of


def saved_at_start(
    watched: Callable[[], Iterable[Any]],
) -> tuple[list[int], list[weakref.ref[torch.Tensor]], list[str]]:
    """(addresses of the CUDA blocks the watched outputs' graphs hold saved, the outputs weakly,
    notes). Never raises: a graph or object that cannot be read is said in the notes."""
    try:
        objects = list(watched())
        known(objects)
        outputs = [
            o for o in objects if issubclass(type(o), torch.Tensor) and o.grad_fn is not None
        ]
        if not outputs:
            return [], [], []
        notes = older_graphs.saved_by_older_graphs(outputs, default_ledger())
        saved = _cuda_addresses(older_graphs.storages_saved_by(outputs))
        return saved, [weakref.ref(o) for o in outputs], notes
    except Exception:
        return [], [], ["what graphs from before the region saved: not read"]


def released(outputs: list[weakref.ref[torch.Tensor]], saved: list[int]) -> set[int]:
    """Of ``saved`` (from `saved_at_start`), the blocks no longer saved now."""
    if not saved:
        return set()
    try:
        alive = [o for o in (r() for r in outputs) if o is not None]
        older_graphs.saved_by_older_graphs(alive, default_ledger())  # (finds them released)
        still = set(_cuda_addresses(older_graphs.storages_saved_by(alive)))
    except Exception:
        return set()
    return set(saved) - still


def known(objects: Iterable[Any]) -> None:
    """Registers the tensors among ``objects`` in the ledger (as existing storages)."""
    ledger = default_ledger()
    for obj in objects:
        if issubclass(type(obj), torch.Tensor):
            with contextlib.suppress(Exception):
                st = storage_of(obj)
                if st is not None:
                    ledger.existing(obj, st)


def _cuda_addresses(storages: Iterable[Any]) -> list[int]:
    return [st.data_ptr() for st in storages if st.device.type == "cuda"]
