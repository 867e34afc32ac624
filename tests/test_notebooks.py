"""Notebooks are tests too: each one in notebooks/ runs top to bottom and is committed executed.
The course's run in JupyterLab served from the Binder environment (tests/test_browser.py); the
others run here, in a fresh kernel of this environment, and in the Binder one
(tests/test_binder.py)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "notebooks/ is empty"


#: The course's notebooks run in JupyterLab (Run All, in Chromium: tests/test_browser.py).
COURSE = [p for p in NOTEBOOKS if not p.name.startswith("00-")]
OTHERS = [p for p in NOTEBOOKS if p not in COURSE]


@pytest.mark.slow
@pytest.mark.parametrize("path", OTHERS, ids=[p.stem for p in OTHERS])
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_committed_notebook_was_executed_and_carries_its_outputs(path: Path) -> None:
    # so that a reader on GitHub sees results without running it
    committed = nbformat.read(path, as_version=4)
    code = [c for c in committed.cells if c.cell_type == "code" and c.source.strip()]
    assert all(c.execution_count for c in code), f"{path.name}: commit it executed"
    assert sum(len(c.outputs) for c in code) >= len(code) // 2
