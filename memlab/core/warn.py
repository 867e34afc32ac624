"""memlab's own warnings."""

from __future__ import annotations

import warnings


class MemlabWarning(UserWarning):
    """Warnings memlab itself raises."""


class MemlabDeprecationWarning(MemlabWarning, DeprecationWarning):
    """A name kept for one release after it moved or was renamed."""


def moved(old: str, new: str) -> None:
    """Warn that ``old`` is kept for one release and ``new`` is its name now."""
    warnings.warn(
        f"{old} is kept for one release: use {new}.", MemlabDeprecationWarning, stacklevel=3
    )
