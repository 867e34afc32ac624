"""Notebooks are tests too: each one in notebooks/ runs top to bottom in a fresh kernel."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "notebooks/ is empty"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
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
    # The committed copy was executed (every code cell has its count) and carries outputs, so a
    # reader on GitHub sees results without running it.
    committed = nbformat.read(path, as_version=4)
    code = [c for c in committed.cells if c.cell_type == "code" and c.source.strip()]
    assert all(c.execution_count for c in code), f"{path.name}: commit it executed"
    assert sum(len(c.outputs) for c in code) >= len(code) // 2
