"""The Binder environment, built from exactly binder/'s files in a fresh virtualenv (Binder's
order: requirements.txt, then postBuild), once per test session: the Binder tests run the
notebooks in it, and the browser tests serve JupyterLab from it, so that the course runs in
JupyterLab, in Chromium, on what a reader on Binder gets. (binder/apt.txt's graphviz and g++
are taken from this machine: the test suite's own setup installs them.)

The build takes minutes, mostly pip: `start` begins it in a process of its own as soon as the
tests are collected, so that the other tests run meanwhile and no worker waits idle for it
(`ready` is what the tests' fixture calls: the environment, once it is built).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).parent.parent
BINDER = ROOT / "binder"


def sh(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> str:
    done = subprocess.run(
        cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    return done.stdout


def build(base: Path) -> dict[str, str]:
    """The environment's variables (PATH, VIRTUAL_ENV, HOME under ``base``), once it is built."""
    # graphviz for dot; g++ for memlab's native record (compiled on first use)
    assert (BINDER / "apt.txt").read_text().split() == ["graphviz", "g++"]
    assert shutil.which("dot"), "graphviz's dot is missing (binder/apt.txt installs it on Binder)"
    venv, home = base / "venv", base / "home"
    home.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))},
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(home),
        "VIRTUAL_ENV": str(venv),
        "JUPYTER_PLATFORM_DIRS": "1",
    }
    # --retries 0: the PyTorch index that requirements.txt names is out of reach here; the
    # pinned CPU wheel comes from this machine. --no-compile: the modules the notebooks import
    # are compiled to bytecode when first imported, not every module of every package (a
    # minute of the build, beside the other tests)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    pip += ["--retries", "0"]
    sh([*pip, "-r", str(BINDER / "requirements.txt")], env, ROOT, 900)
    sh(["bash", str(BINDER / "postBuild")], env, ROOT, 900)
    return env


def python(env: dict[str, str]) -> str:
    """The Python of the virtualenv whose variables are ``env``."""
    return str(Path(env["VIRTUAL_ENV"]) / "bin" / "python")


class BuildError(RuntimeError):
    """The environment did not build (its error, said once for every test that needs it)."""


def ready(shared: Path) -> dict[str, str]:
    """The environment built in the folder ``shared`` (once: whoever comes first builds it under
    its lock, a test's fixture or `start`'s process, and the others wait for it)."""
    made, failed = shared / "binder-env.json", shared / "binder-env.failed"
    with FileLock(str(shared / "binder-env.lock")):
        if failed.is_file():  # (the first build failed: its error, not a second build)
            raise BuildError(failed.read_text())
        if not made.is_file():
            try:
                base = Path(tempfile.mkdtemp(prefix="binder", dir=shared))
                print(f"process {os.getpid()}: building in {base}", file=sys.stderr, flush=True)
                env = build(base)
            except BaseException as e:
                failed.write_text(f"{type(e).__name__}: {e}")
                raise
            made.write_text(json.dumps(env))
        return json.loads(made.read_text())  # type: ignore[no-any-return]


_started: list[subprocess.Popen[bytes]] = []


def start(shared: Path) -> None:
    """Begins building the environment in ``shared`` in a process of its own (once per folder,
    however many workers ask; its process id in binder-env.started, its output in
    binder-env.log). It lives past the worker that started it (another may be waiting for it),
    in a process group of its own that `stop` ends."""
    try:
        claim = os.open(shared / "binder-env.started", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    try:
        command = [sys.executable, __file__, str(shared)]
        with open(shared / "binder-env.log", "wb") as log:
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
            )
        _started.append(proc)
        os.write(claim, str(proc.pid).encode())
    finally:
        os.close(claim)


def stop(shared: Path) -> None:
    """At the end of the whole run (pytest-xdist's controller, or the only process): a build
    `start` began that is still running is ended with everything it started (pip), so that
    nothing outlives the run (a run cut short, or one whose tests needing it never ran)."""
    try:
        pid = int((shared / "binder-env.started").read_text() or 0)
    except (OSError, ValueError):
        return
    mine = f"{Path(__file__).name}\0{shared}".encode()
    try:  # (the same process: its command line names this file and the folder)
        running = pid > 0 and mine in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        running = False
    if running:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGTERM)
    for proc in _started:  # (a child of this process: reaped)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    _started.clear()


if __name__ == "__main__":  # (`start`'s process)
    try:
        ready(Path(sys.argv[1]))
    except BaseException as e:  # (said to the tests by binder-env.failed)
        print(f"the Binder environment did not build: {e}", file=sys.stderr)
        sys.exit(1)
