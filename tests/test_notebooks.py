"""Notebooks are tests too: each one in notebooks/ runs top to bottom and is committed executed.
Each runs once, where a reader runs it: the course's in JupyterLab served from the Binder
environment (tests/test_browser.py), the others in a fresh kernel of that environment
(tests/test_binder.py). Here: that each one is committed with its outputs; and, where the
environment is not the Binder one (scripts/test_torch.sh sets MEMLAB_NOTEBOOKS_HERE=1: another
torch), that the 00-* ones run in a kernel of this environment."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "notebooks/ is empty"


if os.environ.get("MEMLAB_NOTEBOOKS_HERE") == "1":
    OTHERS = [p for p in NOTEBOOKS if p.name.startswith("00-")]

    @pytest.mark.slow
    @pytest.mark.parametrize("path", OTHERS, ids=[p.stem for p in OTHERS])
    def test_notebook_runs_top_to_bottom_here(path: Path, tmp_path: Path) -> None:
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(
            nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        )
        client.execute()  # raises CellExecutionError, with the cell and its traceback
        errors = [
            o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"
        ]  # fmt: skip
        assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_committed_notebook_was_executed_and_carries_its_outputs(path: Path) -> None:
    # so that a reader on GitHub sees results without running it
    committed = nbformat.read(path, as_version=4)
    code = [c for c in committed.cells if c.cell_type == "code" and c.source.strip()]
    assert all(c.execution_count for c in code), f"{path.name}: commit it executed"
    assert sum(len(c.outputs) for c in code) >= len(code) // 2
