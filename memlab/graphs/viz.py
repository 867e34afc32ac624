"""``memlab.make_dot``: torchviz's drawing, with the bytes each node saved for backward.

A drop-in for ``torchviz.make_dot``: the same arguments and the same ``graphviz.Digraph``, drawn
by torchviz itself; memlab adds to each node's label what it saved (each storage counted once,
charged to the earliest node that saved it, parameters apart: the figures of `memlab.graph_of`),
the exact bytes on hover, and the total in the title. Changing one import upgrades existing
torchviz code: ``from memlab import make_dot``.

torchviz walks the graph recursively, one Python frame per node along the longest path, so a
deep graph (a thousand blocks) passes Python's recursion limit. memlab runs it in a thread of
its own with a stack and a recursion limit sized for the graph's node count (`deep_enough`);
nothing is collapsed.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from memlab.core.autograd import iter_nodes
from memlab.core.frames import users_traceback
from memlab.graphs.args import output_tensors
from memlab.graphs.capture import graph_of_tensors
from memlab.reports.units import fmt_bytes

R = TypeVar("R")
#: Python frames allowed per node of the graph, and C stack per node for the thread (a Python
#: call takes under 1 KiB of it on 3.11+, a few KiB on 3.10), capped: memory is only reserved.
FRAMES_PER_NODE = 2
STACK_PER_NODE = 16 * 1024
MAX_STACK = 1024**3
_LIMIT_LOCK = threading.Lock()


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
    outputs = output_tensors((var,), "memlab.make_dot(var, params)", ("var",))
    graph = graph_of_tensors(outputs, inputs, "memlab.make_dot")  # what has no graph: said
    dot = deep_enough(
        len(graph.nodes),
        lambda: torchviz.make_dot(
            var if isinstance(var, torch.Tensor) else tuple(outputs),  # torchviz: tuples only
            params=dict(params) if params is not None else None,
            show_attrs=show_attrs,
            show_saved=show_saved,
            max_attr_chars=max_attr_chars,
        ),
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
    title = f"{graph.total_text()} saved for backward ({total:,} B), by memlab"
    if not graph.exact:
        title += f"; not counted: {graph.unread} saved tensor(s) or node(s) it cannot read"
    dot.attr(label=title, labelloc="t")
    dot.memlab_graph = graph  # the figures behind the labels, and their notes
    return dot


def deep_enough(nodes: int, fn: Callable[[], R]) -> R:
    """``fn()``, torchviz's recursive walk of a graph of ``nodes`` nodes, run where it cannot
    pass the recursion limit: for a small graph here; else in a thread with a stack sized for
    the graph, the recursion limit raised while it runs and put back after (unless something
    else changed it meanwhile). Its error, if any, is raised here."""
    depth = nodes * FRAMES_PER_NODE + 200
    if depth + 200 < sys.getrecursionlimit():  # the caller's own frames: room left
        return fn()
    done: list[R] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(fn())
        except BaseException as e:  # raised in the caller's thread below
            failed.append(e)

    with _LIMIT_LOCK:  # (the limit read under it: never another call's raised one)
        base = sys.getrecursionlimit()
        raised = base + depth
        sys.setrecursionlimit(raised)
        old_stack = threading.stack_size(min(MAX_STACK, max(nodes * STACK_PER_NODE, 1 << 20)))
        try:
            worker = threading.Thread(target=run, name="memlab make_dot", daemon=True)
            worker.start()
        finally:
            threading.stack_size(old_stack)
        try:
            worker.join()
        finally:
            if sys.getrecursionlimit() == raised:
                sys.setrecursionlimit(base)
    if failed:
        raise failed[0]
    return done[0]
