"""``$name`` and ``{name}`` in a ``%gpumem`` line, expanded only where the line has them.

IPython expands them in every magic's line unless the magic opts out, and to do so it copies the
whole namespace at every call: with 10,000 names in the notebook, tenths of a millisecond per
tracked cell. ``%%gpumem`` and ``%gpumem`` opt out and ask for the expansion themselves when the
options hold a ``$`` or a ``{``, with the names IPython would have used (the notebook's, and the
locals of the frame that called the magic). The statement of ``%gpumem STATEMENT`` is never
expanded: it is Python, where ``{x}`` in an f-string means what Python says.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from IPython.core.interactiveshell import InteractiveShell

#: The shell's methods that call a magic, and how many frames above them IPython reads the
#: locals of when it expands (see InteractiveShell.run_cell_magic / run_line_magic).
_RUNNERS = {"run_cell_magic": 2, "run_line_magic": 1}


def expand(shell: Any, text: str) -> str:
    """``text`` with IPython's variable expansion, or ``text`` itself where it has none."""
    if "$" not in text and "{" not in text:
        return text
    here = sys._getframe(0)
    hops = _hops_to_callers_frame(here)
    del here
    # var_expand reads the locals `depth + 1` frames above itself, i.e. `hops` above this one;
    # without a runner on the stack it reads the notebook's names alone (its ValueError path)
    return str(shell.var_expand(text, hops if hops is not None else sys.getrecursionlimit() + 1))


def _hops_to_callers_frame(here: FrameType) -> int | None:
    """How many frames above ``here`` IPython's expansion would read the locals of: counted
    from InteractiveShell's own method on the stack (a subclass's override calls it)."""
    codes = {}
    for name, default in _RUNNERS.items():
        code = getattr(getattr(InteractiveShell, name, None), "__code__", None)
        if code is not None:
            codes[code] = default
    frame: FrameType | None = here
    hops = 0
    while frame is not None:
        if frame.f_code in codes:
            depth = frame.f_locals.get("stack_depth", codes[frame.f_code])
            return hops + (depth if isinstance(depth, int) and depth >= 0 else codes[frame.f_code])
        frame, hops = frame.f_back, hops + 1
    return None
