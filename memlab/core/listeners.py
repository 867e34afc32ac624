"""The ledger's listeners (a region's recorders, a pre-flight's replay): attached and detached
under the ledger's lock, and told of each event one by one. A listener that raises is counted
and its note kept; the others still hear the event, so one listener's bug never starves the rest,
and the regions open meanwhile say how many events were lost (`memlab.track.lost`)."""

from __future__ import annotations

import threading
from typing import Any

from memlab.core.frames import described
from memlab.core.storages import Listener


class Listeners:
    """The listening half of `memlab.core.ledger.Ledger`."""

    _lock: threading.RLock

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        #: Events a listener raised on, and what the latest few raised (repeats once).
        self.failures = 0
        self.failure_notes: list[str] = []

    def settle(self) -> None:
        raise NotImplementedError

    def attach(self, listener: Listener) -> None:
        with self._lock:
            self.settle()
            self._listeners.append(listener)

    def detach(self, listener: Listener) -> None:
        with self._lock:
            self.settle()
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _tell(self, device: str, event: str, *args: Any) -> None:
        """Each listener on ``device`` hears ``event``; one that raises is counted, not heard."""
        for listener in self._listeners:
            if listener.device == device:
                try:
                    getattr(listener, event)(*args)
                except Exception as e:
                    self._failed(listener, e)

    def missed_since(self, before: int, notes: list[str]) -> int:
        """The listeners' failures since ``before`` (`failures` when a region began), said in
        ``notes``: events of the region that a recorder or a replay may have missed."""
        n = self.failures - before
        if n:
            said = "; ".join(self.failure_notes[-2:])
            notes.append(f"{n} event(s) not taken in by memlab's listeners ({said})")
        return n

    def _failed(self, listener: Listener, e: Exception) -> None:
        self.failures += 1
        note = f"{type(listener).__name__} failed: {described(e)}"
        if not self.failure_notes or self.failure_notes[-1] != note:
            self.failure_notes[:] = [*self.failure_notes[-4:], note]  # the latest few
