"""The user's traceback without memlab in it: what a cell raises under ``%%gpumem`` shows the
cell's own lines and the libraries it called, as it would without the magic."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import TracebackType

_MEMLAB = str(Path(__file__).parents[1])  # the memlab package
#: PyTorch's own frames between an op and a dispatch mode: there only because memlab's mode is.
_PLUMBING = tuple(
    str(Path(*parts))
    for parts in (
        ("torch", "_compile.py"),
        ("torch", "_dynamo", "eval_frame.py"),
        ("torch", "_dynamo", "external_utils.py"),
        ("torch", "_ops.py"),
        ("torch", "utils", "_python_dispatch.py"),
    )
)


def _file(tb: TracebackType) -> str:
    return tb.tb_frame.f_code.co_filename


def without_memlab(e: BaseException) -> BaseException:
    """``e`` with memlab's frames taken out of its traceback, and PyTorch's dispatch plumbing
    next to them. Returns ``e`` (changed in place, as ``with_traceback`` does)."""
    entries: list[TracebackType] = []
    tb = e.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    drop = {i for i, t in enumerate(entries) if _file(t).startswith(_MEMLAB)}
    if not drop:
        return e
    grown = True
    while grown:  # plumbing that leads into or out of a dropped frame goes too
        grown = False
        for i, t in enumerate(entries):
            if i not in drop and _file(t).endswith(_PLUMBING) and {i - 1, i + 1} & drop:
                drop.add(i)
                grown = True
    kept = [t for i, t in enumerate(entries) if i not in drop]
    for a, b in itertools.pairwise(kept):
        a.tb_next = b
    if kept:
        kept[-1].tb_next = None
    return e.with_traceback(kept[0] if kept else None)
