"""A Ctrl-C that lands after the cell's code ran to its end, while memlab closes the region or
draws its plot, stops memlab's work, not the cell: the cell keeps its value (``Out``) and its
variables, succeeds, and shows no frame of memlab's; the region is closed whole and its report
says that a Ctrl-C came."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import run

from memlab.magic import cell as cell_module
from memlab.region import args as region_args
from memlab.region import measure


@pytest.fixture
def interrupt_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The region's first close is cut by a Ctrl-C (before it did anything: closing resumes)."""
    calls: list[int] = []
    close = measure.track._close

    def cut(self: Any, et: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        close(self, et)

    monkeypatch.setattr(measure.track, "_close", cut)
    return calls


@pytest.mark.parametrize("options", ["", "-b", "-q"])
def test_a_ctrl_c_while_memlab_closes_keeps_the_cells_value(
    ip: Any, interrupt_once: list[int], options: str, capsys: Any
) -> None:
    r = run(ip, f"%%gpumem {options} -o rep\nx = torch.ones(1000)\n5 + 2")
    assert r.success and r.result == 7 and ip.user_ns["x"].numel() == 1000
    assert len(interrupt_once) == 2  # (closed again, whole)
    rep = ip.user_ns["rep"]
    assert rep.allocated_delta == 4000 and rep.raised is None
    assert region_args.CLOSED_THROUGH_CTRL_C in rep.notes
    assert cell_module.CUT_SHORT in capsys.readouterr().out


def test_a_ctrl_c_while_the_plot_is_drawn_keeps_the_cell_a_success(
    ip: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from memlab.magic import magics

    def interrupted(fig: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(magics, "_png", interrupted)
    r = run(ip, "%%gpumem -t\nkeep = [torch.ones(10) for _ in range(50)]\nlen(keep)")
    assert r.success and r.result == 50
    assert "no timeline plot for this cell: interrupted" in capsys.readouterr().out


def test_a_ctrl_c_in_the_cells_own_code_still_stops_it(ip: Any) -> None:
    r = run(ip, "%%gpumem\ny = 1\nraise KeyboardInterrupt")
    assert not r.success and isinstance(r.error_in_exec, KeyboardInterrupt)
