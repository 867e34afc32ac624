"""DOT text for an annotated graph, and SVG through graphviz's ``dot``.

Heat colours by bytes saved (log scale) with a legend; nodes grouped in nested clusters by the
module that made them; a module-level view that collapses modules into one box each. A leaf
(parameter) used by many nodes is drawn without its edges, whose fan-in makes ``dot``'s layout
take minutes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from memlab.graphs.collapse import MAX_DRAWN, plan
from memlab.graphs.model import Graph, Node, module_at
from memlab.graphs.runs import HUB, Group, consumers_of
from memlab.reports.units import fmt_bytes

#: Light to dark oranges: more bytes saved, darker.
PALETTE = ("#fff5eb", "#fee6ce", "#fdd0a2", "#fdae6b", "#fd8d3c", "#f16913", "#d94801")
#: A box with more inputs than this is drawn without its in-edges.
FAN_IN = 32
#: The most module clusters a drawing nests its nodes in, and how deep they nest.
MAX_CLUSTERS = 120
MAX_NESTING = 8


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


def check_drawing(depth: Any, limit: Any) -> None:
    """A ValueError that names ``depth`` or ``limit`` when it is not what a drawing takes."""
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ValueError(f"limit must be a positive int or None (draw everything), not {limit!r}")
    if depth is not None and (type(depth) is not int or depth < 1):
        raise ValueError(
            f"depth must be a positive int (one box per module that many levels deep) or None "
            f"(every node), not {depth!r}"
        )


def to_dot(graph: Graph, depth: int | None = None, limit: int | None = MAX_DRAWN) -> str:
    """DOT text: every node (``depth=None``) or one box per module cut to ``depth``; at most
    ``limit`` boxes (repeats collapsed, the rest summed up, see `memlab.graphs.collapse`)."""
    check_drawing(depth, limit)
    nodes = graph.nodes
    if depth is None:
        keys = [str(n.id) for n in nodes]
        unit_of = list(range(len(nodes)))
    else:
        keys = sorted({module_at(n.module, depth) for n in nodes})
        index = {k: u for u, k in enumerate(keys)}
        unit_of = [index[module_at(n.module, depth)] for n in nodes]
    consumers = consumers_of(graph)
    p = plan(
        graph, unit_of, len(keys), len(keys) if limit is None else limit, depth is None, consumers
    )
    prefix = "n" if depth is None else "m"
    box = [f"g{g}" if (g := p.group_of[u]) >= 0 else f"{prefix}{u}" for u in unit_of]
    groups = {g: p.groups[g] for g in dict.fromkeys(p.group_of) if g >= 0}
    totals = graph.by_module(depth) if depth is not None else {}
    singles = {u: k for u, k in enumerate(keys) if p.group_of[u] < 0}
    heat = _Heat(
        [g.saved(nodes) for g in groups.values()]
        + [nodes[u].bytes if depth is None else totals[k][0] for u, k in singles.items()]
    )
    # A node used by many is drawn without its out-edges (in the module view: a leaf).
    hub = [len(c) > HUB and (depth is None or bool(nodes[i].leaf)) for i, c in enumerate(consumers)]
    pairs = (
        (box[i], box[n.id]) for n in nodes for i in n.inputs if not hub[i] and box[i] != box[n.id]
    )
    edges = list(dict.fromkeys(pairs))
    if depth is not None:  # in the order of the module names (groups last)
        edges.sort(key=lambda e: (_name(e[0], keys), _name(e[1], keys)))
    fan_out: dict[str, set[str]] = defaultdict(set)
    fan_in: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        fan_out[a].add(b)
        fan_in[b].add(a)
    busy = {a for a, b in fan_out.items() if len(b) > HUB}
    sinks = {b for b, a in fan_in.items() if len(a) > FAN_IN}
    out = [
        "digraph memlab {",
        'graph [rankdir=TB, fontname="Helvetica", fontsize=10, newrank=true];',
        'node [shape=box, style="filled,rounded", fontname="Helvetica", fontsize=9, height=0.2];',
        'edge [arrowsize=0.5, color="#777777"];',
    ]
    if p.notes:
        out.append(f"graph [label={q(chr(10).join(p.notes))}, labelloc=t, labeljust=l];")

    def note(name: str, uses: int) -> str:
        text = f"\nused by {uses} nodes" if uses else ""
        text += f"\nused by {len(fan_out[name])} boxes" if name in busy else ""
        return text + (f"\n{len(fan_in[name])} inputs (edges not drawn)" if name in sinks else "")

    lines: dict[str, list[str]] = defaultdict(list)
    types = dict(graph.module_types)
    for u, k in singles.items():
        name = f"{prefix}{u}"
        if depth is None:
            uses = len(consumers[u]) if hub[u] else 0
            lines[nodes[u].module].append(_node_line(nodes[u], heat, note(name, uses)))
        else:
            saved, count = totals[k]
            kind = types.get(k)  # a Sequential's child "3" reads as "3 (Linear)"
            title = f"{k} ({kind})" if k and kind else k or "(top level)"
            label = f"{title}\n{count} node{'s' * (count != 1)} · {fmt_bytes(saved)}"
            tip = f"{k}: {saved:,} B saved by {count} autograd nodes"
            lines[""].append(
                f"{name} [label={q(label + note(name, 0))}, fillcolor={q(heat.colour(saved))}, "
                f"tooltip={q(tip)}];"
            )
    for g, group in groups.items():
        where = group.cluster if depth is None else ""
        lines[where].append(_group_line(g, group, nodes, heat, note(f"g{g}", 0)))
    out += _clusters(lines, graph) if depth is None else lines[""]
    out += [f"{a} -> {b};" for a, b in edges if a not in busy and b not in sinks]
    out += heat.legend()
    out.append("}")
    return "\n".join(out) + "\n"


def _name(box: str, keys: list[str]) -> tuple[int, str]:
    return (0, keys[int(box[1:])]) if box[0] == "m" else (1, box)


def _node_line(n: Node, heat: _Heat, note: str) -> str:
    if n.leaf:
        return (
            f"n{n.id} [label={q(n.leaf + note)}, shape=ellipse, fillcolor={q('#e8f1e4')}, "
            f"tooltip={q(_tooltip(n))}];"
        )
    label = n.op + (f"\n{fmt_bytes(n.bytes)}" if n.bytes else "") + note
    return (
        f"n{n.id} [label={q(label)}, fillcolor={q(heat.colour(n.bytes))}, "
        f"tooltip={q(_tooltip(n))}];"
    )


def _group_line(g: int, group: Group, nodes: Sequence[Node], heat: _Heat, note: str) -> str:
    saved = group.saved(nodes)
    style = "filled,dashed" if group.more else "filled,rounded,bold"
    tip = f"{group.title}: {saved:,} B saved by {len(group.members):,} autograd nodes"
    return (
        f"g{g} [label={q(group.label(nodes) + note)}, style={q(style)}, "
        f"fillcolor={q(heat.colour(saved))}, tooltip={q(tip)}];"
    )


def _clusters(by_module: dict[str, list[str]], graph: Graph) -> list[str]:
    """Nested ``subgraph cluster_*`` blocks, one per module path, holding their lines; at most
    `MAX_CLUSTERS` (deeper modules are drawn in their ancestor's cluster)."""
    by_module = _cut_clusters(by_module)
    below: dict[str, int] = defaultdict(int)  # bytes under each module path, itself included
    for path, (b, _) in graph.by_module(None).items():
        prefix = ""
        for part in path.split(".", MAX_NESTING)[:MAX_NESTING] if path else []:
            prefix = f"{prefix}.{part}" if prefix else part
            below[prefix] += b
    children: dict[str, set[str]] = defaultdict(set)
    for path in by_module:
        parts = path.split(".") if path else []
        for k in range(1, len(parts) + 1):
            children[".".join(parts[: k - 1])].add(".".join(parts[:k]))
    lines = list(by_module.get("", []))
    counter = 0
    stack: list[str | None] = [c for c in sorted(children.get("", ()), reverse=True)]
    while stack:  # depth first, with explicit stack: module nesting of any depth
        top = stack.pop()
        if top is None:
            lines.append("}")
            continue
        path = top
        counter += 1
        lines.append(
            f"subgraph cluster_{counter} {{ label={q(f'{path} · {fmt_bytes(below[path])}')}; "
            'fontsize=9; style=rounded; color="#aaaaaa";'
        )
        lines.extend(by_module.get(path, []))
        stack.append(None)
        stack.extend(sorted(children.get(path, ()), reverse=True))
    return lines


def _cut_clusters(by_module: dict[str, list[str]]) -> dict[str, list[str]]:
    """Module paths cut to the depth (at most `MAX_NESTING`) at which they make at most
    `MAX_CLUSTERS` clusters: graphviz lays out many or deeply nested clusters very slowly."""
    ids: dict[tuple[int, str], int] = {}
    per_level: list[set[int]] = []
    for path in by_module:
        parent = -1
        for k, part in enumerate(path.split(".") if path else []):
            parent = ids.setdefault((parent, part), len(ids))
            if k == len(per_level):
                per_level.append(set())
            per_level[k].add(parent)
    depth, clusters = 0, 0
    while depth < min(len(per_level), MAX_NESTING):
        clusters += len(per_level[depth])
        if clusters > MAX_CLUSTERS:
            break
        depth += 1
    if depth == len(per_level):
        return by_module
    out: dict[str, list[str]] = defaultdict(list)
    for path, lines in by_module.items():
        out[module_at(path, depth) if depth else ""].extend(lines)
    return out


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
