"""The course's exercise checks: feedback without echoing True/False, and solution cells that do
not give the answers away when every cell is run."""

from __future__ import annotations

import pytest

from memlab.course import check


def test_a_right_answer_says_so_and_returns_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert check(4096, 4096) is None  # a cell ending with check() shows no Out
    assert capsys.readouterr().out == "Right: 4.00 KiB (4,096 B)\n"


def test_a_solution_cell_does_not_print_the_answer(capsys: pytest.CaptureFixture[str]) -> None:
    assert check(2_102_272, 2_102_272, solution=True) is None
    out = capsys.readouterr().out
    assert "agrees with the measurement" in out and "2,102,272" not in out and "MiB" not in out


def test_unanswered_reminds_and_wrong_raises(capsys: pytest.CaptureFixture[str]) -> None:
    assert check(None, 10) is None
    assert "Not answered yet" in capsys.readouterr().out
    with pytest.raises(AssertionError, match=r"your answer is 8 B \(8 B\), the measurement"):
        check(8, 10)
    check(102, 100, bytes=False, rel=0.05)
    assert capsys.readouterr().out == "Right: 102, measured 100\n"
    with pytest.raises(TypeError, match="answer must be a number, not str"):
        check("12", 12)  # type: ignore[arg-type]
