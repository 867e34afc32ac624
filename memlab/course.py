"""Exercise checks for the teaching notebooks: the reader's answer against a measured number.

``check(answer, measured)`` says whether a computed-by-hand answer matches what memlab measured.
An exercise left unanswered (``None``) is not an error, so the notebooks still run top to bottom;
each exercise's collapsed solution cell calls ``check`` with the worked answer.
"""

from __future__ import annotations

from memlab.reports.units import fmt_bytes


def check(
    answer: float | None,
    measured: float,
    *,
    bytes: bool = True,
    rel: float = 0.0,
    solution: bool = False,
) -> None:
    """Says whether ``answer`` is within ``rel`` (relative) of ``measured``; AssertionError when
    not. Returns nothing, so that a cell ending with it shows no ``Out``.

    answer: your number (``None``: not answered yet, which only prints a reminder).
    measured: the truth, as measured in the notebook.
    bytes: show both numbers as byte counts (exact bytes and human units).
    rel: the relative tolerance, e.g. 0.05 for within 5 %.
    solution: the call of a collapsed solution cell: on success it says so without the number,
        so that running every cell does not give the answers away.
    """
    show = (lambda n: f"{fmt_bytes(int(n))} ({int(n):,} B)") if bytes else (lambda n: f"{n:,}")
    if answer is None:
        print("Not answered yet: set your answer above and run this cell again (the solution is")
        print("in the collapsed cell below; click its '…' to open it).")
        return
    if not isinstance(answer, (int, float)):
        raise TypeError(f"answer must be a number, not {type(answer).__name__} ({answer!r}).")
    if abs(answer - measured) <= rel * abs(measured):
        if solution:
            print("The solution agrees with the measurement (open the cell to see it).")
        else:
            print(f"Right: {show(answer)}" + (f", measured {show(measured)}" if rel else ""))
        return
    raise AssertionError(
        f"Not quite: your answer is {show(answer)}, the measurement is {show(measured)}"
        + (f" (allowed: ±{rel:.0%})" if rel else "")
        + "."
    )
