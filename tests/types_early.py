"""The type check (mypy over memlab, about two minutes of one core) started when the session's
tests are collected, in a process of its own at a lower priority, so that it runs in the time
the workers leave a core idle (a browser test waiting for its page, a kernel starting) instead
of holding one worker for its whole length; `tests/test_packaging.py` reads its result.

Once per session folder, however many workers ask (a claim file, as `binder_env.start`). Where
it was not started (the test run alone, say), the test runs mypy itself."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
TEST = "test_packaging.py::test_lint_and_types[mypy]"


def executable(name: str) -> str | None:
    """A tool of the test environment (``ruff``, ``mypy``): beside this Python's, else on PATH."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


def start(shared: Path) -> None:
    """mypy begins in ``shared`` (its output in types.log, its exit status in types.rc)."""
    try:
        claim = os.open(shared / "types.started", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    mypy = executable("mypy")
    try:
        if mypy is None:
            return  # (the test says it is not installed)
        script = (  # (the status written whole: the test reads it once the file is there)
            '"$1" > "$2/types.log" 2>&1; echo $? > "$2/types.rc.part"; '
            'mv "$2/types.rc.part" "$2/types.rc"'
        )
        proc = subprocess.Popen(
            ["nice", "-n", "10", "sh", "-c", script, "sh", mypy, str(shared)],
            cwd=ROOT,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.write(claim, str(proc.pid).encode())
    except OSError:
        pass  # (the test runs it itself)
    finally:
        os.close(claim)


def result(shared: Path, timeout: float = 900) -> tuple[int, str] | None:
    """(exit status, output) of the mypy `start` began, once it is done; None where none was
    started (or it went away without a status)."""
    started = shared / "types.started"
    if not started.is_file():
        return None
    rc = shared / "types.rc"
    deadline = time.monotonic() + timeout
    while not rc.is_file():
        if time.monotonic() > deadline or not _alive(started):
            return None
        time.sleep(0.5)
    return int(rc.read_text().strip() or 1), (shared / "types.log").read_text()


def _alive(started: Path) -> bool:
    try:
        pid = int(started.read_text() or 0)
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    try:  # (a process that ended and was not reaped yet is a zombie: "Z")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        state = "" if _exists(pid) else "Z"
    return state != "Z" or (started.parent / "types.rc").is_file()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def stop(shared: Path) -> None:
    """At the end of the run: a mypy still running (a run cut short) is ended."""
    try:
        pid = int((shared / "types.started").read_text() or 0)
    except (OSError, ValueError):
        return
    if pid > 0 and not (shared / "types.rc").is_file():
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGTERM)
