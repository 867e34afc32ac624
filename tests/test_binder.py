"""The Binder configuration works: an environment built from exactly binder/'s files, in a fresh
virtualenv, runs every notebook. (binder/apt.txt's graphviz is the one part taken from this
machine: the test suite's own setup installs it.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
BINDER = ROOT / "binder"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

pytestmark = pytest.mark.slow


def sh(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> str:
    done = subprocess.run(
        cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    return done.stdout


@pytest.fixture(scope="module")
def binder_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    # graphviz for dot; g++ for memlab's native record (compiled on first use)
    assert (BINDER / "apt.txt").read_text().split() == ["graphviz", "g++"]
    if shutil.which("dot") is None:
        pytest.fail("graphviz's dot is missing (binder/apt.txt installs it on Binder)")
    base = tmp_path_factory.mktemp("binder")
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
    # Binder's order: requirements.txt, then postBuild. --retries 0: the PyTorch index that
    # requirements.txt names is out of reach here; the pinned CPU wheel comes from this machine.
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--retries", "0"]
    sh([*pip, "-r", str(BINDER / "requirements.txt")], env, ROOT, 900)
    sh(["bash", str(BINDER / "postBuild")], env, ROOT, 900)
    return env


def test_binder_environment_has_what_the_course_needs(binder_env: dict[str, str]) -> None:
    python = str(Path(binder_env["VIRTUAL_ENV"]) / "bin" / "python")
    code = (
        "import torch, memlab, jupyterlab, ipywidgets, torchviz, graphviz, matplotlib;"
        "from IPython.paths import get_ipython_dir;"
        "print(torch.__version__, torch.cuda.is_available(), get_ipython_dir())"
    )
    out = sh([python, "-c", code], binder_env, ROOT, 120).split()
    assert out[0].startswith("2.13.0") and out[1] == "False"
    # postBuild's IPython config loads memlab in every kernel of the Binder image
    config = Path(out[2]) / "profile_default" / "ipython_config.py"
    assert "memlab" in config.read_text()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_the_binder_environment(
    binder_env: dict[str, str], path: Path, tmp_path: Path
) -> None:
    python = str(Path(binder_env["VIRTUAL_ENV"]) / "bin" / "python")
    cmd = [
        python, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
        "--ExecutePreprocessor.timeout=300", "--ExecutePreprocessor.kernel_name=python3",
        f"--output-dir={tmp_path}", str(path),
    ]  # fmt: skip
    sh(cmd, binder_env, path.parent, 600)
    assert (tmp_path / path.name).exists()
