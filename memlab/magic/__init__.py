"""IPython glue: ``%%gpumem``, ``%gpumem``, ``%gpumem_history``, ``%gpumem_auto``."""

from __future__ import annotations

from typing import Any

from memlab.core.native import uninstall as uninstall_native


def load(ipython: Any, preflight: Any = None, after_oom: Any = None) -> None:
    """Registers the magics, once: loading again (``memlab.autoload`` and a notebook's own
    ``%load_ext memlab``) does nothing. ``preflight(spec, namespace, hidden)``: what
    ``%%gpumem --gpu`` replays a cell through; ``after_oom(error, device, namespace, hidden)``:
    what explains an out-of-memory (the estimator's, both passed in from above)."""
    if getattr(ipython, "_memlab_magics", None) is not None:
        return
    from memlab.magic.magics import GpumemMagics

    magics = GpumemMagics(ipython, preflight, after_oom)
    ipython.register_magics(magics)
    ipython._memlab_magics = magics


def unload(ipython: Any) -> None:
    """Removes what ``load`` installed: automatic tracking and the magics themselves (the
    history stays on the shell for a ``%reload_ext``)."""
    magics = getattr(ipython, "_memlab_magics", None)
    if magics is None:
        return
    magics.auto_off()
    manager = ipython.magics_manager
    for kind, names in magics.magics.items():
        for name in names:
            if manager.magics[kind].get(name) is not None:
                del manager.magics[kind][name]
    manager.registry.pop(type(magics).__name__, None)
    del ipython._memlab_magics
    uninstall_native()  # PyTorch's CPU allocator back as it was
