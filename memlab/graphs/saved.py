"""What an autograd node saved for backward, read from its ``_saved_*`` attributes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from memlab.core import _torch

_NAMES: dict[type, tuple[str, ...]] = {}
#: The tensors that hold a sparse tensor's bytes, by layout (public accessors only).
_SPARSE_PARTS = {
    torch.sparse_coo: ("indices", "values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


class GraphFreedError(RuntimeError):
    """The graph's saved tensors were already released by ``backward()``."""


def saved_tensors(node: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(attribute, tensor) for each tensor ``node`` saved. Raises GraphFreedError when backward
    already released them (run the analysis before backward, or backward with retain_graph)."""
    names = _NAMES.get(type(node))
    if names is None:
        names = _NAMES[type(node)] = _torch.saved_attribute_names(node)
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError as e:
            raise GraphFreedError(
                f"{type(node).__name__} was already run by backward(), which freed what it "
                "saved; look at the graph before calling backward()."
            ) from e
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor):
                yield name, t


def storages(t: torch.Tensor) -> tuple[Any, ...] | None:
    """The untyped storages that hold ``t``'s bytes: its one storage, or a sparse tensor's
    indices and values. None where they cannot be read without changing anything (a sparse COO
    tensor that is not coalesced, a tensor subclass or layout without storage)."""
    try:
        layout = t.layout
        if layout == torch.strided:
            return (t.untyped_storage(),)
        parts = _SPARSE_PARTS.get(layout)
        if parts is None:
            return (t.untyped_storage(),)
        if layout == torch.sparse_coo and not t.is_coalesced():
            return None  # its values and indices are private to torch until coalesced
        with torch.no_grad():  # reading the parts of a tensor that requires grad adds no node
            return tuple(getattr(t, p)().untyped_storage() for p in parts)
    except Exception:  # NotImplementedError (no storage), RuntimeError, a subclass's own error
        return None
