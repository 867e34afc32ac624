"""IPython glue: ``%%gpumem``, ``%gpumem``, ``%gpumem_history``, ``%gpumem_auto``."""

from __future__ import annotations

from typing import Any


def load(ipython: Any) -> None:
    from memlab.magic.magics import GpumemMagics

    magics = GpumemMagics(ipython)
    ipython.register_magics(magics)
    ipython._memlab_magics = magics


def unload(ipython: Any) -> None:
    magics = getattr(ipython, "_memlab_magics", None)
    if magics is not None:
        magics.auto_off()
        del ipython._memlab_magics
