"""A cell keeps its meaning under the magic: the user's traceback without memlab's frames, a
`__future__` import that holds for later cells, the variable name Python will look up, the
history across a reload, and nothing of memlab's left after an unload."""

from __future__ import annotations

import traceback
from typing import Any

import pytest
from conftest import run


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from memlab.core import devices

    monkeypatch.setattr(devices, "_cuda_count", lambda: 0)


def frames(ip: Any) -> list[str]:
    """The files of the last error's traceback, as %debug and IPython would walk it."""
    import sys

    tb = sys.last_traceback
    return [f.filename for f in traceback.extract_tb(tb)]


@pytest.mark.parametrize("breakdown", ["", "-b"])
def test_a_torch_error_shows_the_cell_and_no_memlab_frame(ip: Any, breakdown: str) -> None:
    r = run(ip, f"%%gpumem {breakdown}\nx = torch.ones(3)\ny = x @ torch.ones(4)")
    assert isinstance(r.error_in_exec, RuntimeError)
    files = frames(ip)
    assert not [f for f in files if "/memlab/" in f], files
    assert not [f for f in files if f.endswith(("_ops.py", "eval_frame.py", "_compile.py"))]
    assert any(f.startswith("<ipython-input") or "ipykernel" in f or "<" in f for f in files)


def test_an_error_raised_in_a_python_library_function_keeps_that_frame(ip: Any) -> None:
    run(ip, "import torch.nn.functional as F")
    r = run(ip, "%%gpumem -b\nF.cross_entropy(torch.ones(2, 3), torch.tensor([0, 7]))")
    assert r.error_in_exec is not None
    files = frames(ip)
    assert any(f.endswith("functional.py") for f in files)  # the user called it: it stays
    assert not [f for f in files if "/memlab/" in f]


def test_a_syntax_error_has_no_memlab_frame(ip: Any) -> None:
    r = run(ip, "%%gpumem\nx = (\n")
    assert isinstance(r.error_in_exec or r.error_before_exec, SyntaxError)
    assert not [f for f in frames(ip) if "/memlab/" in f]


def test_a_future_import_in_a_tracked_cell_holds_for_later_cells(ip: Any) -> None:
    run(ip, "%%gpumem -q\nfrom __future__ import annotations\nx = torch.ones(2)")
    r = run(ip, "def f(a: NotDefinedAnywhere) -> int:\n    return 1\nann = f.__annotations__")
    assert r.success and ip.user_ns["ann"] == {"a": "NotDefinedAnywhere", "return": "int"}


def test_out_names_are_the_ones_python_looks_up(ip: Any) -> None:
    run(ip, "%%gpumem -q -o µ\nx = torch.ones(2)")  # typed: MICRO SIGN
    r = run(ip, "found = µ.peak_allocated")  # Python reads it as GREEK SMALL LETTER MU
    assert r.success and ip.user_ns["found"] == 8
    r = run(ip, "%gpumem_leaks -o ｌｅａｋｓ")  # fullwidth letters normalise to ascii
    assert r.success and "leaks" in ip.user_ns


@pytest.mark.parametrize("bad", ["1x", "class", "a-b"])
def test_a_bad_out_name_is_a_usage_error(ip: Any, bad: str) -> None:
    from IPython.core.error import UsageError

    for line in (f"%%gpumem -o {bad}\nx = 1", f"%gpumem_history -o {bad}"):
        r = run(ip, line)
        assert isinstance(r.error_in_exec, UsageError), line


def test_reload_keeps_the_history_and_unload_removes_the_magics(ip: Any) -> None:
    run(ip, "%%gpumem -q\nx = torch.ones(4)")
    run(ip, "%%gpumem -q\ny = torch.ones(4)")
    assert len(ip._memlab_magics.history) == 2
    ip.run_line_magic("reload_ext", "memlab")
    assert len(ip._memlab_magics.history) == 2
    ip.run_line_magic("unload_ext", "memlab")
    try:
        manager = ip.magics_manager.magics
        gone = ("gpumem", "gpumem_history", "gpumem_auto", "gpumem_leaks")
        assert not [n for n in gone if n in manager["line"] or n in manager["cell"]]
    finally:
        ip.run_line_magic("load_ext", "memlab")
    assert len(ip._memlab_magics.history) == 2
