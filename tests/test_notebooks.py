"""Notebooks are tests too: each one in notebooks/ runs top to bottom and is committed executed.
Each runs once, where a reader runs it: the course's in JupyterLab served from the Binder
environment (tests/test_browser.py), the others in a fresh kernel of that environment
(tests/test_binder.py). Here: that each one is committed with its outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "notebooks/ is empty"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_committed_notebook_was_executed_and_carries_its_outputs(path: Path) -> None:
    # so that a reader on GitHub sees results without running it
    committed = nbformat.read(path, as_version=4)
    code = [c for c in committed.cells if c.cell_type == "code" and c.source.strip()]
    assert all(c.execution_count for c in code), f"{path.name}: commit it executed"
    assert sum(len(c.outputs) for c in code) >= len(code) // 2
