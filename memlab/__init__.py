"""memlab: see where PyTorch memory goes, cell by cell.

``import memlab`` imports torch and nothing heavy besides; IPython, matplotlib and the rest are
imported by the pieces that use them. ``%load_ext memlab`` adds the ``%%gpumem`` magics.
"""

from __future__ import annotations

from typing import Any

from memlab.core.categories import Category
from memlab.core.devices import DeviceError
from memlab.core.warn import MemlabDeprecationWarning, MemlabWarning
from memlab.graphs.capture import GraphArgumentError, NoGraphError, graph, graph_of
from memlab.graphs.model import Graph
from memlab.graphs.viz import make_dot
from memlab.region import track
from memlab.reports.report import Breakdown, MemoryReport, Reports, Timeline

__version__ = "0.1.0"

__all__ = [
    "Breakdown",
    "Category",
    "DeviceError",
    "Explorer",
    "Graph",
    "GraphArgumentError",
    "MemlabDeprecationWarning",
    "MemlabWarning",
    "MemoryReport",
    "NoGraphError",
    "Reports",
    "Timeline",
    "graph",
    "graph_of",
    "load_ipython_extension",
    "load_snapshot",
    "make_dot",
    "track",
    "unload_ipython_extension",
]


#: Parts of memlab reachable as attributes after ``import memlab``, imported when first used.
_SUBPACKAGES = (
    "whatif",
    "step",
    "estimate",
    "panel",
    "examples",
    "graphs",
    "reports",
    "course",
    "snapshot",
)


def __getattr__(name: str) -> Any:
    # The panel needs ipywidgets and matplotlib: imported when first asked for, not with memlab.
    if name == "Explorer":
        from memlab.panel import Explorer

        return Explorer
    if name == "load_snapshot":  # numpy and pickle reading: imported when first used
        from memlab.snapshot import load_snapshot

        return load_snapshot
    if name in _SUBPACKAGES:  # memlab.whatif.run(...) after a plain `import memlab`
        import importlib

        return importlib.import_module(f"memlab.{name}")
    raise AttributeError(f"module 'memlab' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext memlab``: register the magics. Does not initialise CUDA."""
    from memlab.magic import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from memlab.magic import unload

    unload(ipython)
