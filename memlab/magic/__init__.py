"""IPython glue: ``%%gpumem``, ``%gpumem``, ``%gpumem_history``, ``%gpumem_auto``."""

from __future__ import annotations

import contextlib
from typing import Any

from memlab.core.native import uninstall as uninstall_native
from memlab.core.parts import part


def load(ipython: Any, preflight: Any = None, after_oom: Any = None) -> None:
    """Registers the magics, once: loading again (``memlab.autoload`` and a notebook's own
    ``%load_ext memlab``) does nothing. ``preflight(spec, namespace, hidden)``: what
    ``%%gpumem --gpu`` replays a cell through; ``after_oom(error, device, namespace, hidden)``:
    what explains an out-of-memory (the estimator's, both passed in from above).

    Magics of an earlier import of memlab (its modules removed from ``sys.modules`` and
    imported again) are replaced: they hold classes the new modules' checks do not know."""
    from memlab.magic.magics import GpumemMagics

    existing = getattr(ipython, "_memlab_magics", None)
    if isinstance(existing, GpumemMagics):
        return
    if existing is not None:
        unload(ipython)
    magics = GpumemMagics(ipython, preflight, after_oom)
    ipython.register_magics(magics)
    ipython._memlab_magics = magics
    _resume(ipython, magics)


def unload(ipython: Any) -> None:
    """Removes what ``load`` installed: automatic tracking (every region it holds open closed)
    and the magics themselves (the history stays on the shell for a ``%reload_ext``)."""
    magics = getattr(ipython, "_memlab_magics", None)
    if magics is None:
        return
    line = getattr(getattr(magics, "auto", None), "line", None)
    if line is not None:  # kept for a load in this same cell (a reload): see `_resume`
        ipython._memlab_auto_resume = (line, _cell(ipython))
    magics.auto_off()
    manager = ipython.magics_manager
    for kind, names in magics.magics.items():
        for name in names:
            if manager.magics[kind].get(name) is not None:
                del manager.magics[kind][name]
    manager.registry.pop(type(magics).__name__, None)
    del ipython._memlab_magics
    uninstall_native()  # PyTorch's CPU allocator back as it was


def _resume(ipython: Any, magics: Any) -> None:
    """``%reload_ext memlab`` (an unload and a load in one cell) keeps ``%gpumem_auto`` on, and
    says so: a reload replaces memlab's code, not the user's choice to track every cell. A load
    in a later cell than the unload starts with it off, as a first load does."""
    resume = getattr(ipython, "_memlab_auto_resume", None)
    with contextlib.suppress(AttributeError):
        del ipython._memlab_auto_resume
    if resume is not None and resume[1] == _cell(ipython):
        magics.resume_auto(resume[0])


def _cell(ipython: Any) -> int:
    return int(getattr(ipython.displayhook, "prompt_count", ipython.execution_count))


def __getattr__(name: str) -> Any:  # (its modules, imported when first asked for)
    return part(__name__, __file__, name)
