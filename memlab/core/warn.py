"""memlab's own warnings."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any


class MemlabWarning(UserWarning):
    """Warnings memlab itself raises."""


class MemlabDeprecationWarning(MemlabWarning, DeprecationWarning):
    """A name kept for one release after it moved or was renamed."""


def moved(old: str, new: str) -> None:
    """Warn that ``old`` is kept for one release and ``new`` is its name now."""
    warnings.warn(
        f"{old} is kept for one release: use {new}.", MemlabDeprecationWarning, stacklevel=3
    )


#: PyTorch's warning when a compiled module runs while global module hooks are in: memlab's
#: own, while a breakdown or timeline follows the modules (they expect the extra call).
_COMPILE_HOOKS = r"Using `torch\.compile\(module\)` when there are global hooks"


def quiet_compile_hooks() -> Callable[[], None]:
    """Ignores PyTorch's warning about global module hooks under ``torch.compile(module)``
    while memlab's hooks are the global ones; returns what takes exactly that filter out (the
    user's own filters, one of the same text included, stay as they were)."""
    before = list(warnings.filters)
    warnings.filterwarnings("ignore", message=_COMPILE_HOOKS, category=UserWarning)
    added = warnings.filters[0]
    if any(f == added for f in before):  # the user's own, moved to the front: left there
        return lambda: None

    def remove() -> None:
        with contextlib.suppress(ValueError):
            filters: Any = warnings.filters  # (a list; typeshed says Sequence)
            filters.remove(added)
            mutated = getattr(warnings, "_filters_mutated", None)
            if callable(mutated):
                mutated()

    return remove
