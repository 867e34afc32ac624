"""A front end's label for a stretch of a region (`memlab.track.phase`): "prefill" and "decode",
a generation's prompt read at once and its tokens made one at a time."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from memlab.core.recorder import Phase


@contextlib.contextmanager
def labelled(accountant: Any, native: Any, name: str) -> Iterator[None]:
    """Within the block, the region's events say phase ``name`` where they would say "forward"
    or "other": told the native record's hooks, else the accountant (none kept: no events)."""
    labels = Phase.NAMES[Phase.PREFILL :]
    if name not in labels:
        raise ValueError(f"phase must be one of {', '.join(map(repr, labels))}, not {name!r}.")
    roles = native.roles if native is not None else None
    if roles is not None:  # the native record's hooks
        outer = roles.label(Phase.NAMES.index(name))
        try:
            yield
        finally:
            roles.label(outer)
        return
    if accountant is None:  # no events are kept: nothing to label
        yield
        return
    outer, accountant.labelled = accountant.labelled, Phase.NAMES.index(name)
    try:
        yield
    finally:
        accountant.labelled = outer
