"""A real ipykernel for tests that must see what a notebook user sees: the iopub messages of each
execution (streams, displays, the cell's value, the error with its traceback) and its status.

The kernel runs this environment's Python with an empty IPython profile, so memlab is loaded only
by the test's own ``%load_ext memlab`` (the lab's config, which loads it everywhere, is off).
"""

from __future__ import annotations

import os
import queue
import re
import time
from dataclasses import dataclass, field
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
#: A frame in memlab's own package (whatever the checkout's folder is called).
MEMLAB_FRAME = re.compile(
    r"memlab[/\\](?:__init__\.py|course\.py|"
    r"(?:core|region|reports|graphs|step|whatif|estimate|panel|magic|examples)[/\\])"
)


def plain(text: str) -> str:
    """``text`` without terminal colours."""
    return _ANSI.sub("", text)


@dataclass
class Outcome:
    """What one execution showed, in order, and how it ended."""

    status: str = ""  # "ok", "error" or "aborted"
    streams: list[tuple[str, str]] = field(default_factory=list)  # (name, text)
    displays: list[dict[str, Any]] = field(default_factory=list)  # display_data bundles
    result: dict[str, Any] | None = None  # execute_result bundle
    ename: str | None = None
    evalue: str | None = None
    traceback: list[str] = field(default_factory=list)  # lines, colours removed
    kinds: list[str] = field(default_factory=list)  # msg types in order
    seconds: float = 0.0
    interrupts: int = 0

    @property
    def value(self) -> str | None:
        """The cell's value as IPython shows it (``text/plain`` of the execute_result)."""
        return None if self.result is None else str(self.result.get("text/plain"))

    @property
    def stdout(self) -> str:
        return "".join(t for n, t in self.streams if n == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(t for n, t in self.streams if n == "stderr")

    @property
    def shown(self) -> str:
        """Everything shown as text: streams, the displays' and the value's text/plain and HTML."""
        parts = [t for _, t in self.streams]
        for bundle in [*self.displays, *([self.result] if self.result else [])]:
            parts += [str(bundle.get(k, "")) for k in ("text/plain", "text/html")]
        return "\n".join(parts)

    @property
    def reports(self) -> list[str]:
        """The text/plain of memlab's displays (cell reports, one-line summaries, tables)."""
        return [str(d.get("text/plain", "")) for d in self.displays if "memlab" in str(d)]

    @property
    def tb(self) -> str:
        return "\n".join(self.traceback)

    def memlab_frames(self) -> list[str]:
        """Traceback lines that point into memlab's package."""
        return [line for line in self.traceback if MEMLAB_FRAME.search(line)]

    def describe(self) -> str:
        """A short account for assertion messages."""
        out = [f"status={self.status} kinds={self.kinds}"]
        if self.ename:
            out.append(f"error {self.ename}: {self.evalue}")
        if self.value is not None:
            out.append(f"value {self.value[:300]!r}")
        for name, text in self.streams:
            out.append(f"{name}: {text[-600:]!r}")
        for d in self.displays:
            out.append(f"display: {str(d.get('text/plain', ''))[:400]!r}")
        if self.traceback:
            out.append("traceback:\n" + self.tb[-3000:])
        return "\n".join(out)


class KernelTimeoutError(AssertionError):
    pass


class Kernel:
    """One ipykernel; ``run(code)`` executes a cell and returns its `Outcome`."""

    def __init__(self, ipython_dir: str, setup: str = "") -> None:
        from jupyter_client.manager import start_new_kernel

        self.env = {
            **os.environ,
            "IPYTHONDIR": ipython_dir,
            "MEMLAB_NO_AUTOLOAD": "1",
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        }
        self.setup = setup
        self.km, self.kc = start_new_kernel(kernel_name="python3", env=self.env)
        self.restarts = 0
        if setup:
            self._setup()

    def _setup(self) -> None:
        out = self.run(self.setup, timeout=120)
        assert out.status == "ok", out.describe()

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)

    # -- executing ----------------------------------------------------------------------------
    def send(self, code: str) -> str:
        return str(self.kc.execute(code, store_history=True, allow_stdin=False))

    def collect(self, msg_id: str, timeout: float = 60.0, out: Outcome | None = None) -> Outcome:
        """The messages of execution ``msg_id`` until the kernel is idle again, and its reply
        (added to ``out`` when given, so that a timed-out wait can be resumed)."""
        out = out if out is not None else Outcome()
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KernelTimeoutError(
                    f"no answer within {timeout:.0f} s; so far: {out.describe()}"
                )
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 5.0))
            except queue.Empty:
                if not self.km.is_alive():
                    raise AssertionError(f"the kernel died; so far: {out.describe()}") from None
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status":
                if content["execution_state"] == "idle":
                    break
                continue
            if kind not in ("stream", "display_data", "execute_result", "error"):
                continue  # execute_input, widgets' comm messages, clear_output
            out.kinds.append(kind)
            if kind == "stream":
                out.streams.append((content["name"], content["text"]))
            elif kind == "display_data":
                out.displays.append(content["data"])
            elif kind == "execute_result":
                out.result = content["data"]
            elif kind == "error":
                out.ename, out.evalue = content["ename"], content["evalue"]
                out.traceback = [plain(line) for line in content["traceback"]]
        out.seconds += time.monotonic() - t0
        while True:
            reply = self.kc.get_shell_msg(timeout=max(deadline - time.monotonic(), 10.0))
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        out.status = reply["content"]["status"]
        if out.status == "error" and out.ename is None:
            out.ename = reply["content"].get("ename")
            out.evalue = reply["content"].get("evalue")
        return out

    def run(self, code: str, timeout: float = 60.0) -> Outcome:
        """Execute ``code`` as a notebook cell. On a timeout the kernel is interrupted (and
        restarted, with the setup run again, if that does not bring it back), then the test
        fails with what the cell had shown."""
        msg_id = self.send(code)
        try:
            return self.collect(msg_id, timeout)
        except KernelTimeoutError:
            self.recover(msg_id)
            raise

    def recover(self, msg_id: str) -> None:
        self.km.interrupt_kernel()
        try:
            self.collect(msg_id, 15.0)
        except AssertionError:
            self.km.restart_kernel(now=True)
            self.kc.stop_channels()
            self.kc = self.km.client()
            self.kc.start_channels()
            self.kc.wait_for_ready(timeout=60)
            self.restarts += 1
            if self.setup:
                self._setup()

    def value(self, expr: str, timeout: float = 60.0) -> str:
        """``expr``'s value as IPython shows it; fails the test if it raises."""
        out = self.run(expr, timeout)
        assert out.status == "ok" and out.value is not None, out.describe()
        return out.value

    def alive(self) -> bool:
        """Whether the kernel still answers ``1+1`` with 2."""
        try:
            return self.run("1+1", timeout=30).value == "2"
        except AssertionError:
            return False

    def interrupted(self, code: str, after: float, marker: str = "started") -> Outcome:
        """Execute ``code`` and interrupt the kernel (as the notebook's stop button does)
        ``after`` seconds after the cell prints ``marker``. An interrupt that the kernel swallows
        is repeated (up to 5 times); ``Outcome.interrupts`` says how many it took."""
        msg_id = self.send(code)
        out = Outcome()
        deadline = time.monotonic() + 60
        while marker not in out.stdout:  # the cell is running the user's code
            if time.monotonic() > deadline:
                self.recover(msg_id)
                raise KernelTimeoutError(f"{marker!r} never printed; so far {out.describe()}")
            try:
                msg = self.kc.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.kinds.append(kind)
                out.streams.append((content["name"], content["text"]))
            elif kind == "status" and content["execution_state"] == "idle":
                raise AssertionError(f"the cell ended before the interrupt: {out.describe()}")
        time.sleep(after)
        for _ in range(5):
            self.km.interrupt_kernel()
            out.interrupts += 1
            try:
                return self.collect(msg_id, 10.0, out)
            except KernelTimeoutError:
                continue
        self.recover(msg_id)
        raise KernelTimeoutError(f"5 interrupts did not stop the cell: {out.describe()}")
