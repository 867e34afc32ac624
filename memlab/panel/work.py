"""Long panel work on a thread of its own: the kernel stays responsive, the controls that would
conflict are disabled, the status line shows progress and the time taken, and Cancel stops the
work at the next step boundary, keeping what was found."""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from memlab.core.frames import described

#: How often the status line's elapsed time is refreshed, in seconds.
TICK = 0.5


class Work:
    """At most one piece of work at a time. ``say(text, problem)`` writes the status line."""

    def __init__(
        self, controls: Sequence[Any], cancel: Any, say: Callable[[str, bool], None]
    ) -> None:
        self.controls = list(controls)
        self.cancel_button = cancel
        self.say = say
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._text = ""
        self._started = 0.0
        self._lock = threading.Lock()
        #: A message the work said (its result, an error) stays: the ticker stops writing.
        self._silent = False
        cancel.on_click(lambda _: self.cancel())

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def cancelled(self) -> bool:
        return self._stop.is_set()

    def start(self, what: str, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` on a thread; False (and nothing started) while other work runs."""
        if self.running:
            self.say("busy: wait for the work under way, or press Cancel", True)
            return False
        self._stop.clear()
        self._done.clear()
        self._silent = False
        self._started = time.perf_counter()
        self._text = what
        for c in self.controls:
            c.disabled = True
        self.cancel_button.layout.display = ""
        self._tell()
        # a daemon: a kernel shut down mid-search does not wait for it
        self._thread = threading.Thread(
            target=self._main, args=(fn,), name="memlab-panel", daemon=True
        )
        self._thread.start()
        threading.Thread(target=self._ticker, name="memlab-panel-ticker", daemon=True).start()
        return True

    def progress(self, text: str) -> None:
        """What the work is doing now (shown with the time taken so far)."""
        with self._lock:
            self._silent = False
            self._text = text
        self._tell()

    def said(self) -> None:
        """The work wrote a message that must stay (a result, an error)."""
        with self._lock:
            self._silent = True

    def cancel(self) -> None:
        if self.running:
            self._stop.set()
            self._text += " · cancelling after this step"
            self._tell()

    def wait(self, timeout: float | None = None) -> None:
        """Until the work is done (for programs and tests that press the buttons)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _main(self, fn: Callable[[], Any]) -> None:
        try:
            fn()  # fn reports its own result and errors on the status line
        except BaseException as e:  # (what fn let through: a bug of memlab's, said and shown)
            with contextlib.suppress(BaseException):
                self.said()
                self.say(f"the work stopped: {described(e)}", True)
                if not isinstance(e, (KeyboardInterrupt, SystemExit)):
                    traceback.print_exception(e)  # (to the kernel's stderr, as a thread's would)
        finally:
            self._done.set()
            for c in self.controls:
                c.disabled = False
            self.cancel_button.layout.display = "none"

    def _ticker(self) -> None:
        while not self._done.wait(TICK):
            self._tell()

    def _tell(self) -> None:
        with self._lock:
            if not self._done.is_set() and not self._silent:
                elapsed = time.perf_counter() - self._started
                self.say(f"{self._text} · {elapsed:.1f} s", False)
