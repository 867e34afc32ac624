"""``memlab.mark``: say what a tensor is in the region open on this thread, where memlab cannot
tell by itself: a key/value cache your own generation loop keeps in a list (memlab names Hugging
Face's caches, and the caches of its own generate mode), an input made inside the cell, a
buffer kept outside any module. Under ``%%gpumem -b`` there is no region object to call
``mark`` on: this names the tensor in every region open on this thread (as memlab names a
Hugging Face cache), and does nothing where none is open, so that the same loop runs
unmeasured too (a what-if run's warm-up, a cell without ``%%gpumem``)."""

from __future__ import annotations

from typing import Any

import torch

from memlab.core.categories import Category
from memlab.core.frames import users_traceback
from memlab.region.overlap import open_here

#: The roles a program may give (the others are derived when the report is built).
ROLES = tuple(
    c for c in Category if c not in (Category.TEMPORARY, Category.OTHER, Category.UNATTRIBUTED)
)


@users_traceback()
def mark(tensor: Any, role: Category | str) -> None:
    """Names ``tensor``'s memory ``role`` ("kv_cache", "input", "activation", "parameter",
    "buffer", "gradient", "optimizer_state", ...) in each region open on this thread (a
    ``%%gpumem -b`` cell's, a ``with memlab.track(breakdown=True)`` block's); outside one,
    nothing.

    >>> with memlab.track(breakdown=True) as t:  # doctest: +SKIP
    ...     cache = [torch.cat([k, new_k], dim=2) for k, new_k in ...]
    ...     for k in cache:
    ...         memlab.mark(k, "kv_cache")
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"memlab.mark: tensor must be a torch.Tensor, got {type(tensor).__name__}: pass "
            "each tensor of a list or a tuple in a call of its own."
        )
    allowed = ", ".join(repr(c.value) for c in ROLES)
    try:
        category = Category(role)
    except ValueError:
        category = None
    if category not in ROLES:
        raise ValueError(f"memlab.mark: role={role!r} is not one of {allowed}.")
    for region in open_here():
        region.mark(tensor, category)
