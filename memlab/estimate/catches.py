"""Where a cell catches the out-of-memory error its pre-flight predicts.

A cell that runs out of memory inside ``try: ... except torch.OutOfMemoryError:`` (a batch size
halved until it fits, a fallback to the CPU) never raises on the CPU, where the pre-flight runs
it: the ``except`` branch the GPU would run is not in the replay. The pre-flight says so, and
where. The error is an instance of ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``),
of ``RuntimeError``, ``Exception`` and ``BaseException``: a handler for any of those, or a bare
``except``, catches it.
"""

from __future__ import annotations

import ast
import inspect
import linecache
from collections.abc import Iterable

#: The names (bare or as an attribute, ``torch.cuda.OutOfMemoryError``) of what catches it.
CATCHES_OOM = frozenset({"OutOfMemoryError", "RuntimeError", "Exception", "BaseException"})
_TRIES = (ast.Try, *((ast.TryStar,) if hasattr(ast, "TryStar") else ()))


def innermost(filename: str | None) -> int | None:
    """The innermost line of the file ``filename`` (the cell's) on the stack now."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_filename == filename:
            return frame.f_lineno
        frame = frame.f_back
    return None


def on_stack(filename: str | None) -> tuple[int, ...]:
    """The lines of the file ``filename`` (the cell's) on the stack now, innermost first."""
    lines, frame = [], inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_filename == filename:
            lines.append(frame.f_lineno)
        frame = frame.f_back
    return tuple(lines)


def catching(filename: str | None, lines: Iterable[int]) -> int | None:
    """The line of the cell's ``except`` that catches an out-of-memory error raised while
    ``lines`` (innermost first) were running; None where none does (or the cell cannot be
    read)."""
    source = "".join(linecache.getlines(filename)) if filename else ""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    tries = [n for n in ast.walk(tree) if isinstance(n, _TRIES) and n.body]
    for line in lines:
        around = [t for t in tries if t.body[0].lineno <= line <= _end(t.body[-1])]
        for t in sorted(around, key=lambda t: t.body[0].lineno, reverse=True):  # innermost
            for handler in t.handlers:
                if _catches_oom(handler.type):
                    return int(handler.lineno)
    return None


def _end(node: ast.stmt) -> int:
    return node.end_lineno if node.end_lineno is not None else node.lineno


def _catches_oom(kind: ast.expr | None) -> bool:
    if kind is None:  # a bare except
        return True
    if isinstance(kind, ast.Tuple):
        return any(_catches_oom(k) for k in kind.elts)
    if isinstance(kind, ast.Attribute):
        return kind.attr in CATCHES_OOM
    return isinstance(kind, ast.Name) and kind.id in CATCHES_OOM
