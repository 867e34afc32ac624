"""``$name`` and ``{name}`` in ``%%gpumem`` / ``%gpumem`` options: expanded as IPython would,
only where the line has them (no copy of the namespace at every cell), and never inside the
statement of ``%gpumem STATEMENT``, which is Python."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import run

import memlab


@pytest.fixture
def expansions(ip: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every line the shell is asked to expand in the test, as given."""
    seen: list[str] = []
    own = ip.var_expand

    def counting(cmd: str, depth: int = 0, **kw: Any) -> Any:
        seen.append(cmd)
        return own(cmd, depth + 1, **kw)

    monkeypatch.setattr(ip, "var_expand", counting)
    return seen


def test_a_plain_line_is_not_expanded_at_all(ip: Any, expansions: list[str]) -> None:
    for _ in range(3):
        assert run(ip, "%%gpumem -q -d cpu -o _r\nx = 1").success
    assert run(ip, "%gpumem -q -o _r y = 2").success
    assert expansions == []
    assert isinstance(ip.user_ns["_r"], memlab.MemoryReport)


@pytest.mark.parametrize("line", ["-q -l $lab -o _r", "-q -o _r {lab}", "-q -l {lab} -o _r"])
def test_a_cells_options_name_the_notebooks_variables(
    ip: Any, expansions: list[str], line: str
) -> None:
    ip.user_ns["lab"] = "epoch3"
    assert run(ip, f"%%gpumem {line}\nx = 1").success
    assert ip.user_ns["_r"].label == "epoch3"
    assert expansions == [line]


def test_the_statement_of_the_line_form_stays_python(ip: Any, expansions: list[str]) -> None:
    """IPython would have put x's value into both strings before Python saw them."""
    ip.user_ns["x"] = 5
    assert run(ip, '%gpumem -q s = "{x} costs $x"').success
    assert ip.user_ns["s"] == "{x} costs $x"
    assert run(ip, '%gpumem -q t = f"{x}{{x}}"').success
    assert ip.user_ns["t"] == "5{x}"
    assert expansions == []
    assert run(ip, '%gpumem -q -l $x -o _r u = "$x"').success
    assert ip.user_ns["_r"].label == "5" and ip.user_ns["u"] == "$x"
    assert expansions == ["-q -l $x -o _r"]


def test_a_line_magic_called_in_a_function_reads_its_locals_as_ipython_does(ip: Any) -> None:
    """IPython expands a line magic's ``$name`` with the locals of the frame that called
    ``run_line_magic``; a cell magic's with those of the frame above its caller."""
    ip.user_ns["lab"] = "outer"
    source = (
        "def f():\n"
        "    lab = 'inner'\n"
        "    get_ipython().run_line_magic('gpumem', '-q -l $lab -o _line v = 1')\n"
        "    get_ipython().run_cell_magic('gpumem', '-q -l $lab -o _cell', 'w = 1')\n"
        "f()"
    )
    assert run(ip, source).success
    assert ip.user_ns["_line"].label == "inner"
    assert ip.user_ns["_cell"].label == "outer"


def test_an_expansion_that_fails_leaves_the_line_as_given(ip: Any) -> None:
    """`{no_such_name}` cannot be formatted: IPython keeps the line, and so does memlab."""
    result = run(ip, "%%gpumem -q -o _r {no_such_name}\nx = 1")
    assert result.success
    assert ip.user_ns["_r"].label == "{no_such_name}"
