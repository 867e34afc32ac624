"""Ctrl-C held off while memlab finishes work that must not be cut (a big region's settling).

A region's end can take seconds after millions of events. A Ctrl-C that cut it would leave the
work to be done again from its start (`memlab.track` closes a region again after a Ctrl-C), so a
user pressing Ctrl-C twice or three times would wait longer, not less. Inside `held_interrupts`
a Ctrl-C is noted instead, and delivered when the block ends, to the handler that was in place
(Python's own raises ``KeyboardInterrupt``, as it would have): the work is done once, and the
program is interrupted right after it."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

_Handler = Callable[[int, FrameType | None], Any]


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """Holds Ctrl-C (SIGINT) off during the block, on the main thread, where Python runs signal
    handlers; elsewhere, or where SIGINT is ignored or left to the system, the block runs as it
    is. Puts back the handler it replaced only where its own is still the one in place (a
    handler the block installed stays)."""
    before = _handler()
    if before is None:
        yield
        return
    came: list[FrameType | None] = []

    def note(signum: int, frame: FrameType | None) -> None:
        came.append(frame)

    try:
        signal.signal(signal.SIGINT, note)
    except (ValueError, OSError):  # (not the main interpreter)
        yield
        return
    try:
        yield
    except BaseException:  # (the block's error goes on: a Ctrl-C held meanwhile with it)
        _put_back(note, before)
        raise
    _put_back(note, before)
    if came:  # delivered now, as it would have been (default_int_handler raises)
        before(signal.SIGINT, came[-1])


def _put_back(ours: _Handler, before: _Handler) -> None:
    if signal.getsignal(signal.SIGINT) is ours:  # (a handler the block installed stays)
        signal.signal(signal.SIGINT, before)


def _handler() -> _Handler | None:
    """The Python function handling SIGINT now, where holding it off is possible."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        handler = signal.getsignal(signal.SIGINT)
    except (ValueError, OSError):
        return None
    return handler if callable(handler) else None
