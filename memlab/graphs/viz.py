"""``memlab.make_dot``: torchviz's drawing, with the bytes each node saved for backward.

A drop-in for ``torchviz.make_dot``: the same arguments and the same ``graphviz.Digraph``, drawn
by torchviz itself; memlab adds to each node's label what it saved (each storage counted once,
charged to the earliest node that saved it, parameters apart: the figures of `memlab.graph_of`),
the exact bytes on hover, and the total in the title. Changing one import upgrades existing
torchviz code: ``from memlab import make_dot``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from memlab.core.autograd import iter_nodes
from memlab.core.frames import users_traceback
from memlab.graphs.args import output_tensors
from memlab.graphs.capture import graph_of
from memlab.reports.units import fmt_bytes


class TorchvizMissingError(ImportError):
    """torchviz could not be imported."""


@users_traceback()
def make_dot(
    var: Any,
    params: Mapping[str, torch.Tensor] | None = None,
    show_attrs: bool = False,
    show_saved: bool = False,
    max_attr_chars: int = 50,
    *,
    inputs: Any = (),
) -> Any:
    """``torchviz.make_dot(var, params, ...)``, each autograd node labelled with the bytes it
    saved for backward. ``var``: the output (a tensor, or a tuple/list/dict of them, as torchviz
    takes); ``params``: names for the leaves, e.g. ``dict(model.named_parameters())``.
    ``inputs`` (memlab's own, optional): the forward's inputs, whose bytes are then listed apart
    from the activations, as `memlab.track` counts them."""
    try:
        import torchviz
    except Exception as e:  # missing, or (Python 3.12+) without setuptools' distutils shim
        raise TorchvizMissingError(
            f"memlab.make_dot draws with torchviz, which did not import ({type(e).__name__}: "
            f"{e}). Install it (`pip install torchviz`, and `setuptools` on Python 3.12+), or "
            "use memlab.graph_of(output).svg(), memlab's own drawing."
        ) from e
    outputs = output_tensors((var,))
    graph = graph_of(*outputs, inputs=inputs)  # a clear error for what has no graph
    dot = torchviz.make_dot(
        var if isinstance(var, torch.Tensor) else tuple(outputs),  # torchviz takes tuples only
        params=dict(params) if params is not None else None,
        show_attrs=show_attrs,
        show_saved=show_saved,
        max_attr_chars=max_attr_chars,
    )
    # graph_of numbers the nodes in the order core.autograd.iter_nodes walks them
    fns = list(iter_nodes([t.grad_fn for t in outputs if t.grad_fn is not None]))
    for node in graph.nodes:
        fn = fns[node.id]
        name = type(fn).__name__
        if node.bytes:
            label = f"{name}\nsaved {fmt_bytes(node.bytes)}"
            tip = f"{name}: {node.bytes:,} B saved for backward (each storage counted once)"
            dot.node(str(id(fn)), label=label, tooltip=tip)
    total = graph.activation_bytes
    dot.attr(label=f"{fmt_bytes(total)} saved for backward ({total:,} B), by memlab", labelloc="t")
    dot.memlab_graph = graph  # the figures behind the labels
    return dot
