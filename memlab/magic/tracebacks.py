"""The user's traceback without memlab in it: what a cell raises under ``%%gpumem`` shows the
cell's own lines and the code it called, as it would without the magic."""

from __future__ import annotations

import itertools
import sysconfig
from pathlib import Path
from types import TracebackType
from typing import Any

_MEMLAB = str(Path(__file__).parents[1])  # the memlab package
#: Where library code lives (the standard library, installed packages): frames there that
#: memlab called (a thread it waited for, the op its dispatch mode ran) are not the user's.
_LIBRARIES = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)
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
    """``e`` with memlab's frames taken out of its traceback, with the library frames memlab
    called and PyTorch's dispatch plumbing that leads into memlab's mode. Returns ``e`` (changed
    in place, as ``with_traceback`` does)."""
    entries: list[TracebackType] = []
    tb = e.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    drop: set[int] = set()
    called_by_memlab = False
    for i, t in enumerate(entries):
        name = _file(t)
        if name.startswith(_MEMLAB):
            drop.add(i)
            called_by_memlab = True
        elif called_by_memlab and name.startswith(_LIBRARIES):
            drop.add(i)
        else:
            called_by_memlab = False  # the user's code again (the cell, or what it called)
    if not drop:
        return e
    for i in range(len(entries) - 1, -1, -1):  # plumbing that leads into a dropped frame
        if i not in drop and i + 1 in drop and _file(entries[i]).endswith(_PLUMBING):
            drop.add(i)
    kept = [t for i, t in enumerate(entries) if i not in drop]
    for a, b in itertools.pairwise(kept):
        a.tb_next = b
    if kept:
        kept[-1].tb_next = None
    return e.with_traceback(kept[0] if kept else None)


def show_without_memlab(
    shell: Any, etype: type[BaseException], value: BaseException, tb: Any, tb_offset: Any = None
) -> list[str]:
    """IPython's custom exception handler while %gpumem_auto is on: the traceback as IPython
    would show it, less memlab's frames."""
    without_memlab(value)
    shell.showtraceback((etype, value, value.__traceback__), tb_offset=tb_offset)
    return []
