"""The Binder configuration works: an environment built from exactly binder/'s files, in a fresh
virtualenv (tests/binder_env.py), has what the course needs and runs every notebook: the course's
in JupyterLab served from it (tests/test_browser.py), the others here."""

from __future__ import annotations

from pathlib import Path

import pytest
from binder_env import ROOT, python, sh

#: The notebooks the browser tests do not run (they run the course's in JupyterLab, served
#: from this environment).
NOTEBOOKS = sorted((ROOT / "notebooks").glob("00-*.ipynb"))

pytestmark = pytest.mark.slow


def test_binder_environment_has_what_the_course_needs(binder_env: dict[str, str]) -> None:
    code = (
        "import torch, memlab, jupyterlab, ipywidgets, torchviz, graphviz, matplotlib;"
        "from IPython.paths import get_ipython_dir;"
        "print(torch.__version__, torch.cuda.is_available(), get_ipython_dir())"
    )
    out = sh([python(binder_env), "-c", code], binder_env, ROOT, 120).split()
    assert out[0].startswith("2.13.0") and out[1] == "False"
    # postBuild's IPython config loads memlab in every kernel of the Binder image
    config = Path(out[2]) / "profile_default" / "ipython_config.py"
    assert "memlab" in config.read_text()
    # postBuild compiled the native record and its hooks: a reader's first cells never wait
    built = sorted(p.name for p in (Path(binder_env["HOME"]) / ".cache" / "memlab").glob("*.so"))
    assert len(built) >= 2, built


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_the_binder_environment(
    binder_env: dict[str, str], path: Path, tmp_path: Path
) -> None:
    cmd = [
        python(binder_env), "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
        "--ExecutePreprocessor.timeout=300", "--ExecutePreprocessor.kernel_name=python3",
        f"--output-dir={tmp_path}", str(path),
    ]  # fmt: skip
    # (the kernel's torch on one thread, beside the other test worker: tests/jupyterlab_driver.py)
    sh(cmd, {**binder_env, "OMP_NUM_THREADS": "1"}, path.parent, 600)
    assert (tmp_path / path.name).exists()
