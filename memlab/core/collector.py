"""Python's collector held off while memlab makes many objects that are no garbage (a snapshot's
millions of events, a region's many survivors): each of its full passes walks every object made
so far, so that such a loop costs about twice its own work. Left on or off as it was after."""

from __future__ import annotations

import gc
from collections.abc import Callable


def _nothing() -> None:
    pass


def hold_collector(when: bool = True) -> Callable[[], None]:
    """Takes the collector off where ``when`` and it is on; returns what puts it back (call it
    in a ``finally``)."""
    if not (when and gc.isenabled()):
        return _nothing
    gc.disable()
    return gc.enable
