"""The user's traceback without memlab in it: what a cell raises under ``%%gpumem`` shows the
cell's own lines and the code it called, as it would without the magic."""

from __future__ import annotations

import sys
from typing import Any

from memlab.core.frames import without_memlab

__all__ = ["chained_to", "show_without_memlab", "without_memlab"]


def show_without_memlab(
    shell: Any, etype: type[BaseException], value: BaseException, tb: Any, tb_offset: Any = None
) -> list[str]:
    """IPython's custom exception handler while %gpumem_auto is on: the traceback as IPython
    would show it, less memlab's frames."""
    without_memlab(value)
    try:
        shell.showtraceback((etype, value, value.__traceback__), tb_offset=tb_offset)
    except Exception as e:  # its own __str__ raised: shown as IPython shows that, and the
        # handler stays registered (IPython unregisters a handler that raises)
        try:
            without_memlab(e)
            shell.showtraceback((type(e), e, e.__traceback__))
        except Exception:
            print(f"{etype.__name__}: <its message could not be shown>", file=sys.stderr)
    return []


def chained_to(types: tuple[type[BaseException], ...], theirs: Any) -> Any:
    """`show_without_memlab` in front of the user's own custom exception handler (``theirs``,
    for ``types``, as IPython keeps it): the exceptions it handles reach it without memlab's
    frames, the others are shown as IPython shows them, without memlab's frames too."""

    def handler(
        shell: Any, etype: type[BaseException], value: BaseException, tb: Any, tb_offset: Any = None
    ) -> Any:
        if issubclass(etype, types):
            without_memlab(value)
            return theirs(etype, value, value.__traceback__, tb_offset=tb_offset)
        return show_without_memlab(shell, etype, value, tb, tb_offset)

    return handler
