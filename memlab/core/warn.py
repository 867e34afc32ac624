"""memlab's own warnings."""

from __future__ import annotations

import re
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
#: The filter, as `warnings.filterwarnings` would make it (made once: this runs at every region).
_FILTER = ("ignore", re.compile(_COMPILE_HOOKS, re.I), UserWarning, None, 0)


def quiet_compile_hooks() -> Callable[[], None]:
    """Ignores PyTorch's warning about global module hooks under ``torch.compile(module)``
    while memlab's hooks are the global ones; returns what takes exactly that filter out. A
    filter of the same text already there (the user's own, or an enclosing region's) is left
    where it is, and the other filters stay in their order.

    The filter goes in and out without telling the warnings machinery its filters changed
    (`warnings.filterwarnings` does): that would empty every module's record of the warnings
    it has shown, and a warning of the program's that shows once per line would show again
    after every region. An "ignore" filter of one message needs no such reset: that message is
    not recorded while it is in, and no other message's record depends on it."""
    filters: Any = warnings.filters  # (a list; typeshed says Sequence)
    if _FILTER in filters:
        return _nothing
    filters.insert(0, _FILTER)

    def remove() -> None:
        for i, f in enumerate(filters):  # (this list: a catch_warnings block may have ended)
            if f is _FILTER:
                del filters[i]
                return

    return remove


def _nothing() -> None:
    pass
