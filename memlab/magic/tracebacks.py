"""The user's traceback without memlab in it: what a cell raises under ``%%gpumem`` shows the
cell's own lines and the code it called, as it would without the magic."""

from __future__ import annotations

from typing import Any

from memlab.core.frames import without_memlab

__all__ = ["show_without_memlab", "without_memlab"]


def show_without_memlab(
    shell: Any, etype: type[BaseException], value: BaseException, tb: Any, tb_offset: Any = None
) -> list[str]:
    """IPython's custom exception handler while %gpumem_auto is on: the traceback as IPython
    would show it, less memlab's frames."""
    without_memlab(value)
    shell.showtraceback((etype, value, value.__traceback__), tb_offset=tb_offset)
    return []
