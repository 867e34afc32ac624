"""The annotated graph as plain data: nodes, what each saved, which module made it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from html import escape
from typing import Any

from memlab.core._torch import SAVED_PREFIX
from memlab.core.frames import users_traceback
from memlab.graphs.collapse import MAX_DRAWN
from memlab.reports.frame import frame, heading, note, num_cell, table, text_cell
from memlab.reports.protocol import Result
from memlab.reports.units import fmt_bytes

#: What a saved tensor is, for the graph: memory autograd alone keeps (activation, charged to the
#: earliest node that saved it), memory another node already accounts for (shared), memory
#: that exists anyway (parameter or buffer, an input of the forward), memory whose bytes
#: cannot be read (unread: a tensor without storage, as an MKL-DNN one; not counted), and a
#: Python number an op wrapped as a tensor (number: ``x * 0.5``'s 0.5, a few bytes on the host
#: made outside any op; not counted, as `memlab.track` does not count it), and a tensor an
#: activation checkpoint packed as a placeholder (recomputed: backward recomputes it from the
#: checkpoint's inputs, which are counted instead). A hook's packed value has no shape or dtype.
KINDS = ("activation", "shared", "parameter", "input", "unread", "number", "recomputed")


@dataclass(frozen=True)
class Saved:
    attr: str
    shape: tuple[int | str, ...]  # a nested tensor's ragged dimension as text
    dtype: str
    nbytes: int  # the bytes of the whole storage this tensor views
    kind: str

    def describe(self) -> str:
        shape = "×".join(map(str, self.shape)) or "scalar"
        name = self.attr.removeprefix(SAVED_PREFIX)
        if not self.dtype and self.kind == "recomputed":  # a checkpoint's placeholder
            return f"{name}: recomputed in backward by its activation checkpoint"
        if not self.dtype:  # another hook's packed value: no shape, no bytes to read
            return f"{name}: packed by a saved-tensors hook, not readable ({self.kind})"
        return f"{name}: {shape} {self.dtype}, {fmt_bytes(self.nbytes)} ({self.kind})"


@dataclass(frozen=True)
class Node:
    id: int
    op: str
    module: str  # dotted module path ("" outside every module)
    bytes: int  # activation bytes charged to this node
    saved: tuple[Saved, ...]
    inputs: tuple[int, ...]  # ids of the nodes backward goes to next
    leaf: str | None = None  # for AccumulateGrad: the parameter's name, or "input"


@dataclass(frozen=True)
class Graph(Result):
    """An autograd graph annotated with the bytes each node saved for backward.

    ``activation_bytes`` counts each saved storage once (charged to the earliest node that saved
    it) and leaves out parameters, buffers and the forward's inputs, which exist anyway: it
    equals what ``memlab.track(breakdown=True)`` reports as activation for the same forward
    (keys and values a KV cache also holds are its ``kv_cache`` there). Where ``unread`` is
    not 0, saved tensors memlab cannot read are left out and it is a lower bound (``exact``).
    In a notebook it shows the drawing (SVG) above `html`, its table of the heaviest nodes.
    """

    css = "memlab-graph"

    nodes: tuple[Node, ...]
    roots: tuple[int, ...]
    #: Bytes of the parameter and buffer storages the graph saved, each once (not activations:
    #: they exist anyway).
    saved_parameter_bytes: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: (module path, class name) of each module of the model (``memlab.graph`` only): how a
    #: drawing names a run of repeated modules.
    module_types: tuple[tuple[str, str], ...] = ()
    #: Saved tensors and nodes whose bytes could not be read (`notes` say which): not counted.
    unread: int = 0

    @property
    def activation_bytes(self) -> int:
        return sum(n.bytes for n in self.nodes)

    @property
    def exact(self) -> bool:
        """Whether every saved tensor was read: else `activation_bytes` is a lower bound."""
        return self.unread == 0

    def total_text(self) -> str:
        """The total as the summaries say it: "at least" where it is a lower bound."""
        return f"{'' if self.exact else 'at least '}{fmt_bytes(self.activation_bytes)}"

    @users_traceback()
    def by_module(self, depth: int | None = None) -> Mapping[str, tuple[int, int]]:
        """Module path (cut to ``depth`` components) -> (activation bytes, node count)."""
        from memlab.graphs.dot import check_drawing

        check_drawing(depth, None)
        out: dict[str, tuple[int, int]] = {}
        for n in self.nodes:
            key = module_at(n.module, depth)
            b, c = out.get(key, (0, 0))
            out[key] = (b + n.bytes, c + 1)
        return out

    @users_traceback()
    def heaviest(self, k: int = 10) -> list[Node]:
        if type(k) is not int or k < 0:
            raise ValueError(f"k must be an int ≥ 0 (how many nodes to list), not {k!r:.40}")
        return sorted((n for n in self.nodes if n.bytes), key=lambda n: -n.bytes)[:k]

    def to_dict(self) -> dict[str, Any]:
        return {
            "activation_bytes": self.activation_bytes,
            "exact": self.exact,
            "saved_parameter_bytes": self.saved_parameter_bytes,
            "nodes": [
                {
                    "id": n.id,
                    "op": n.op,
                    "module": n.module,
                    "bytes": n.bytes,
                    "inputs": list(n.inputs),
                    "leaf": n.leaf,
                    "saved": [
                        {
                            "attr": s.attr,
                            "shape": list(s.shape),
                            "dtype": s.dtype,
                            "nbytes": s.nbytes,
                            "kind": s.kind,
                        }
                        for s in n.saved
                    ],
                }
                for n in self.nodes
            ],
            "roots": list(self.roots),
            "notes": list(self.notes),
        }

    # -- drawing ------------------------------------------------------------------------------
    @users_traceback()
    def dot(self, depth: int | None = None, limit: int | None = MAX_DRAWN) -> str:
        """The DOT text. ``depth``: collapse modules below that many path components into one
        box each (a module-level view); ``None`` draws every node. ``limit``: the most boxes
        drawn; a bigger graph has its repeated parts collapsed and, if need be, the part
        farthest from the output summed up in one box, as the drawing and `notes` say
        (``None`` draws everything, which graphviz may take minutes to lay out)."""
        from memlab.graphs.dot import to_dot

        return to_dot(self, depth, limit)

    @property
    def source(self) -> str:
        return self.dot()

    @users_traceback()
    def svg(self, depth: int | None = None, limit: int | None = MAX_DRAWN) -> str:
        from memlab.graphs.dot import render_svg

        return render_svg(self.dot(depth, limit))

    @users_traceback()
    def view(self, depth: int | None, limit: int | None = MAX_DRAWN) -> GraphView:
        """The module-level view, for display: ``memlab.graph(model, x).view(depth=2)``;
        ``depth=None``: every node (what a small graph shows by default)."""
        from memlab.graphs.dot import check_drawing

        check_drawing(depth, limit)  # said here, not when the view is displayed
        return GraphView(self, depth, limit)

    @users_traceback()
    def table_html(self, k: int = 10) -> str:
        """The ``k`` heaviest nodes, in the frame: what a notebook shows under the drawing."""
        return frame(self.html(k), self.css)

    @users_traceback()
    def html(self, k: int = 10) -> str:
        rows = [
            text_cell(n.op) + text_cell(n.module or "(top level)") + num_cell(n.bytes)
            for n in self.heaviest(k)
        ]
        head = heading(
            f"{self.total_text()} saved for backward in {len(self.nodes)} nodes",
            f"parameters saved alongside: {fmt_bytes(self.saved_parameter_bytes)}",
        )
        body = [head, table(["heaviest node", "module", "saved"], rows, "memlab-graph-table")]
        return "\n".join(body + [note(n) for n in self.notes])

    def auto_depth(self) -> int | None:
        """The module depth a notebook shows by default: every node for a small graph (None);
        for a big one, the deepest module level that still makes at most `AUTO_BOXES` boxes."""
        if len(self.nodes) <= AUTO_NODES or not any(n.module for n in self.nodes):
            return None
        deepest = max(n.module.count(".") + 1 for n in self.nodes if n.module)
        best = 1
        for depth in range(1, deepest + 1):
            if len({module_at(n.module, depth) for n in self.nodes}) > AUTO_BOXES:
                break
            best = depth
        return best

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        return _bundle(self, self.auto_depth())

    def text(self) -> str:
        lines = [
            f"memlab graph: {len(self.nodes)} nodes, {self.total_text()} saved "
            f"for backward (parameters saved alongside: {fmt_bytes(self.saved_parameter_bytes)})"
        ]
        lines += [f"  {fmt_bytes(n.bytes):>10}  {n.op}  {n.module}" for n in self.heaviest()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass(frozen=True)
class GraphView:
    graph: Graph
    depth: int | None
    limit: int | None = MAX_DRAWN

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        return _bundle(self.graph, self.depth, self.limit)

    def __repr__(self) -> str:  # (printed: the graph's summary, not every node's fields)
        shown = "every node" if self.depth is None else f"modules {self.depth} level(s) deep"
        return f"view of {shown}; {self.graph.text()}"

    def svg(self) -> str:
        return self.graph.svg(self.depth, self.limit)

    @property
    def source(self) -> str:
        return self.graph.dot(self.depth, self.limit)


def module_at(path: str, depth: int | None) -> str:
    if depth is None or not path:
        return path
    return ".".join(path.split(".")[:depth])


#: Graphs with more nodes than this are shown module by module by default...
AUTO_NODES = 80
#: ...at the deepest level that makes at most this many boxes.
AUTO_BOXES = 12


def _bundle(graph: Graph, depth: int | None, limit: int | None = MAX_DRAWN) -> dict[str, Any]:
    from memlab.graphs.dot import DotMissingError, render_svg, to_dot

    table = graph.table_html()
    if depth is not None and depth == graph.auto_depth():
        said = (
            f"{len(graph.nodes):,} autograd nodes, shown as one box per module {depth} "
            f"level{'s' * (depth != 1)} deep; every node: g.view(depth=None) or g.svg(), "
            "another level: g.view(depth=N)"
        )
        table = frame(note(said), graph.css) + table
    dot = to_dot(graph, depth, limit)
    try:
        svg = render_svg(dot)
    except DotMissingError as e:
        return {
            "text/plain": f"{e}\n\n{dot}",
            "text/html": f"<div><b>{escape(str(e))}</b></div>{table}"
            f"<details><summary>DOT text</summary><pre>{escape(dot)}</pre></details>",
        }
    return {"text/html": svg + table, "text/plain": str(graph)}
