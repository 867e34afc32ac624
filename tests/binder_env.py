"""The Binder environment, built from exactly binder/'s files in a fresh virtualenv (Binder's
order: requirements.txt, then postBuild), once per test session: the Binder tests run the
notebooks in it, and the browser tests serve JupyterLab from it, so that the course runs in
JupyterLab, in Chromium, on what a reader on Binder gets. (binder/apt.txt's graphviz and g++
are taken from this machine: the test suite's own setup installs them.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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
    # pinned CPU wheel comes from this machine.
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--retries", "0"]
    sh([*pip, "-r", str(BINDER / "requirements.txt")], env, ROOT, 900)
    sh(["bash", str(BINDER / "postBuild")], env, ROOT, 900)
    return env


def python(env: dict[str, str]) -> str:
    """The Python of the virtualenv whose variables are ``env``."""
    return str(Path(env["VIRTUAL_ENV"]) / "bin" / "python")
