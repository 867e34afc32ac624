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
from memlab.region.marking import mark
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
    "mark",
    "track",
    "unload_ipython_extension",
]


def __getattr__(name: str) -> Any:
    # The panel needs ipywidgets and matplotlib: imported when first asked for, not with memlab.
    if name == "Explorer":
        from memlab.panel import Explorer

        return Explorer
    if name == "load_snapshot":  # numpy and pickle reading: imported when first used
        from memlab.snapshot import load_snapshot

        return load_snapshot
    from memlab.core.parts import part  # memlab.whatif.run(...) after a plain `import memlab`

    return part(__name__, __file__, name)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext memlab``: register the magics, and load the native record (or start building
    it on a thread of its own). Does not initialise CUDA."""
    from memlab.core import native
    from memlab.magic import load

    load(ipython, preflight=_preflight, after_oom=_after_oom)
    native.prepare()


def _preflight(spec: str, namespace: dict[str, Any], hidden: Any) -> Any:
    """``%%gpumem --gpu``: the estimator's replay of a cell (the magic's floor cannot import
    the estimator's, so it is passed in from here)."""
    from memlab.core.ledger import default_ledger
    from memlab.estimate.gpus import parse
    from memlab.estimate.preflight import Flight

    return Flight(parse(spec, "--gpu"), default_ledger(), namespace, hidden)


def _after_oom(error: BaseException, device: str, namespace: dict[str, Any], hidden: Any) -> Any:
    """``%%gpumem`` meeting an out-of-memory: the estimator's explanation of it."""
    from memlab.estimate.after_oom import after_oom

    return after_oom(error, device, namespace=namespace, hidden=hidden)


def unload_ipython_extension(ipython: Any) -> None:
    from memlab.magic import unload

    unload(ipython)
