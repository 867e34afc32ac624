"""What an autograd node saved for backward, read from its ``_saved_*`` attributes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from memlab.core._torch_autograd import saved_names, saved_value
from memlab.core.storages import sparse_parts


class GraphFreedError(RuntimeError):
    """The graph's saved tensors were already released by ``backward()``."""


def saved_tensors(node: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(attribute, tensor) for each tensor ``node`` saved. Raises GraphFreedError when backward
    already released them (run the analysis before backward, or backward with retain_graph)."""
    for name in saved_names(node):
        try:
            value = saved_value(node, name)  # never a program's unpack hook (see there)
        except RuntimeError as e:
            raise GraphFreedError(
                f"{type(node).__name__} was already run by backward(), which freed what it "
                "saved; look at the graph before calling backward()."
            ) from e
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor):  # (what a program's hook packed is not read)
                yield name, t


def storages(t: torch.Tensor) -> tuple[Any, ...] | None:
    """The untyped storages that hold ``t``'s bytes: its one storage, or a sparse tensor's
    indices and values (a COO tensor's as they are, coalesced or not). None where there is no
    storage to read (a tensor subclass or layout without one)."""
    try:
        layout = t.layout
        if layout == torch.strided:
            return (t.untyped_storage(),)
        parts = sparse_parts(t)
        if not parts:
            return (t.untyped_storage(),)
        return tuple(p.untyped_storage() for p in parts)
    except Exception:  # NotImplementedError (no storage), RuntimeError, a subclass's own error
        return None
