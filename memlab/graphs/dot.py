"""DOT text for an annotated graph, and SVG through graphviz's ``dot``.

Heat colours by bytes saved (log scale) with a legend; nodes grouped in nested clusters by the
module that made them; a module-level view that collapses modules into one box each. A leaf
(parameter) used by many nodes is drawn without its edges, whose fan-in makes ``dot``'s layout
take minutes.
"""

from __future__ import annotations

import math
from collections import defaultdict

from memlab.graphs.model import Graph, Node, module_at
from memlab.reports.units import fmt_bytes

#: Light to dark oranges: more bytes saved, darker.
PALETTE = ("#fff5eb", "#fee6ce", "#fdd0a2", "#fdae6b", "#fd8d3c", "#f16913", "#d94801")
#: A leaf with more consumers than this is drawn without edges.
HUB = 8


class DotMissingError(RuntimeError):
    """graphviz's ``dot`` executable is not installed."""


def q(text: str) -> str:
    """A DOT quoted string: backslashes and quotes escaped, newlines as DOT line breaks."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class _Heat:
    def __init__(self, values: list[int]) -> None:
        positive = [v for v in values if v > 0]
        self.lo = min(positive, default=1)
        self.hi = max(positive, default=1)

    def colour(self, v: int) -> str:
        if v <= 0:
            return "#ffffff"
        if self.hi == self.lo:
            return PALETTE[-1]
        x = (math.log(v) - math.log(self.lo)) / (math.log(self.hi) - math.log(self.lo))
        return PALETTE[1 + round(x * (len(PALETTE) - 2))]

    def legend(self) -> list[str]:
        if self.hi <= 0:
            return []
        steps = len(PALETTE) - 1
        lines = [
            'subgraph cluster_legend { label="bytes saved for backward"; fontsize=9; '
            'color="#bbbbbb"; style=rounded;'
        ]
        span = math.log(self.hi) - math.log(self.lo)
        shown: set[str] = set()
        for k in range(steps if span else 1):
            v = round(math.exp(math.log(self.lo) + k / max(steps - 1, 1) * span))
            label = fmt_bytes(v)
            if label not in shown:
                shown.add(label)
                lines.append(f"legend{k} [label={q(label)}, fillcolor={q(self.colour(v))}];")
        lines.append("}")
        return lines


def _tooltip(n: Node) -> str:
    head = f"{n.op}" + (f" in {n.module}" if n.module else "")
    if n.leaf:
        return f"{head}\nleaf: {n.leaf}"
    lines = [head, f"charged here: {fmt_bytes(n.bytes)} ({n.bytes:,} B)"]
    lines += [s.describe() for s in n.saved]
    return "\n".join(lines)


def to_dot(graph: Graph, depth: int | None = None) -> str:
    heat_values = list(graph.by_module(depth).values()) if depth is not None else []
    heat = _Heat(
        [b for b, _ in heat_values] if depth is not None else [n.bytes for n in graph.nodes]
    )
    out = [
        "digraph memlab {",
        'graph [rankdir=TB, fontname="Helvetica", fontsize=10, newrank=true];',
        'node [shape=box, style="filled,rounded", fontname="Helvetica", fontsize=9, height=0.2];',
        'edge [arrowsize=0.5, color="#777777"];',
    ]
    consumers: dict[int, int] = defaultdict(int)
    for n in graph.nodes:
        for i in n.inputs:
            consumers[i] += 1
    hubs = {n.id for n in graph.nodes if n.leaf and consumers[n.id] > HUB}

    if depth is None:
        by_module: dict[str, list[str]] = defaultdict(list)
        for n in graph.nodes:
            by_module[n.module].append(_node_line(n, heat, consumers[n.id] if n.id in hubs else 0))
        out += _clusters(by_module, graph)
        for n in graph.nodes:
            for i in n.inputs:
                if i not in hubs:
                    out.append(f"n{i} -> n{n.id};")
    else:
        totals = graph.by_module(depth)
        key_of = {n.id: module_at(n.module, depth) for n in graph.nodes}
        boxes = sorted(set(key_of.values()))
        box_id = {k: f"m{i}" for i, k in enumerate(boxes)}
        for k in boxes:
            b, c = totals[k]
            label = f"{k or '(top level)'}\n{c} node{'s' * (c != 1)} · {fmt_bytes(b)}"
            out.append(
                f"{box_id[k]} [label={q(label)}, fillcolor={q(heat.colour(b))}, "
                f"tooltip={q(f'{k}: {b:,} B saved by {c} autograd nodes')}];"
            )
        edges = {(key_of[i], key_of[n.id]) for n in graph.nodes for i in n.inputs if i not in hubs}
        out += [f"{box_id[a]} -> {box_id[b]};" for a, b in sorted(edges) if a != b]
    out += heat.legend()
    out.append("}")
    return "\n".join(out) + "\n"


def _node_line(n: Node, heat: _Heat, hub_uses: int) -> str:
    if n.leaf:
        label = n.leaf + (f"\nused by {hub_uses} nodes" if hub_uses else "")
        return (
            f"n{n.id} [label={q(label)}, shape=ellipse, fillcolor={q('#e8f1e4')}, "
            f"tooltip={q(_tooltip(n))}];"
        )
    label = n.op + (f"\n{fmt_bytes(n.bytes)}" if n.bytes else "")
    return (
        f"n{n.id} [label={q(label)}, fillcolor={q(heat.colour(n.bytes))}, "
        f"tooltip={q(_tooltip(n))}];"
    )


def _clusters(by_module: dict[str, list[str]], graph: Graph) -> list[str]:
    """Nested ``subgraph cluster_*`` blocks, one per module path, holding their nodes."""
    totals = graph.by_module(None)
    children: dict[str, set[str]] = defaultdict(set)
    for path in by_module:
        parts = path.split(".") if path else []
        for k in range(1, len(parts) + 1):
            children[".".join(parts[: k - 1])].add(".".join(parts[:k]))
    lines = list(by_module.get("", []))
    counter = [0]

    def emit(path: str) -> None:
        counter[0] += 1
        below = [p for p in totals if p == path or p.startswith(path + ".")]
        b = sum(totals[p][0] for p in below)
        lines.append(
            f"subgraph cluster_{counter[0]} {{ label={q(f'{path} · {fmt_bytes(b)}')}; "
            'fontsize=9; style=rounded; color="#aaaaaa";'
        )
        lines.extend(by_module.get(path, []))
        for child in sorted(children.get(path, ())):
            emit(child)
        lines.append("}")

    stack_roots = sorted(children.get("", ()))
    for root in stack_roots:
        emit(root)
    return lines


def render_svg(dot_text: str) -> str:
    import graphviz

    try:
        svg: str = graphviz.Source(dot_text).pipe(format="svg", encoding="utf-8")
    except graphviz.ExecutableNotFound as e:
        raise DotMissingError(
            "Graphviz's `dot` executable was not found on PATH. Install it (apt-get install "
            "graphviz, conda install graphviz, or brew install graphviz), or use the graph's "
            ".source (the DOT text) or .to_dict() instead."
        ) from e
    return svg
