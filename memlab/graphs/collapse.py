"""Bounded drawings of big graphs: repeated parts collapsed, at most `MAX_DRAWN` boxes drawn.

graphviz's layout grows much faster than the graph (a 5,000-layer ``Sequential`` took over a
minute), so a graph of more units (nodes, or module boxes in the module view) than the limit is
drawn with groups:

1. the repeats `memlab.graphs.runs` finds become one box each, the run that saves most boxes
   first, until the drawing fits; a run's first block stays drawn node by node where there is
   room for it;
2. if it still does not fit, the boxes nearest the output are drawn and the rest become one box
   ("… N more nodes").

Byte totals are sums over the nodes, the same whatever is drawn. Every step is linear in the
graph and walks with explicit stacks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memlab.graphs.runs import Group, chain_runs, consumers_of, module_runs
from memlab.reports.units import fmt_bytes

if TYPE_CHECKING:
    from memlab.graphs.model import Graph

#: The most boxes a drawing holds by default (`Graph.dot(limit=None)` draws every node).
MAX_DRAWN = 400


@dataclass
class Plan:
    """Which units are drawn as groups: ``group_of[unit]`` is a group index or -1."""

    groups: list[Group] = field(default_factory=list)
    group_of: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def plan(
    graph: Graph,
    unit_of: list[int],
    units: int,
    limit: int,
    chains: bool,
    consumers: list[list[int]] | None = None,
) -> Plan:
    """Groups that bring ``units`` (``unit_of[node]``: its unit) down to ``limit``; ``chains``:
    look for runs along chains of nodes too (the node view)."""
    out = Plan(group_of=[-1] * units)
    if units <= limit:
        return out
    boxes = "" if chains else f" in {units:,} module boxes"
    candidates = module_runs(graph)
    fitted = _choose(out, candidates, unit_of, units, limit)
    if fitted > limit and chains:  # runs along chains of nodes too, from the start
        out = Plan(group_of=[-1] * units)
        consumers = consumers_of(graph) if consumers is None else consumers
        fitted = _choose(out, candidates + chain_runs(graph, consumers), unit_of, units, limit)
    units = fitted
    if units > limit:
        units = _cut(graph, unit_of, out, limit)
    used = set(out.group_of)
    collapsed = [g for n, g in enumerate(out.groups) if n in used and not g.more]
    line = (
        f"drawing: {len(graph.nodes):,} nodes{boxes} drawn as {units:,} boxes (at most {limit:,})"
    )
    if collapsed:
        shown = "; ".join(g.title.replace("\n", ": ") for g in collapsed[:3])
        line += f"; repeats collapsed: {shown}"
        line += f" and {len(collapsed) - 3} more" if len(collapsed) > 3 else ""
    out.notes.append(line)
    for g in out.groups:
        if g.more:
            saved = fmt_bytes(sum(graph.nodes[i].bytes for i in g.members))
            out.notes.append(
                f"drawing: the {len(g.members):,} nodes farthest from the output are one box "
                f"('… more'), {saved} saved"
            )
    out.notes.append("graph.dot(limit=None) draws every node (graphviz may take minutes)")
    return out


def _choose(out: Plan, candidates: list[Group], unit_of: list[int], units: int, limit: int) -> int:
    """Takes runs into ``out``, the one that saves most boxes first, then their first blocks,
    until ``units`` fit in ``limit``; returns the boxes left."""
    scored = [(len({unit_of[m] for m in g.members}) - 1, -n, g) for n, g in enumerate(candidates)]
    scored.sort(key=lambda s: (-s[0], -s[1]))
    for saving, _, g in scored:
        if units <= limit or saving <= 0:
            break
        mine = {unit_of[m] for m in g.members}
        if any(out.group_of[u] >= 0 for u in mine):
            continue
        for u in mine:
            out.group_of[u] = len(out.groups)
        out.groups.append(g)
        units -= saving
    for index in sorted(range(len(out.groups)), key=lambda x: -len(out.groups[x].head)):
        if units <= limit:
            break
        heads = {unit_of[m] for m in out.groups[index].head}
        if heads and all(out.group_of[u] < 0 for u in heads):  # the first block too
            out.groups[index] = out.groups[index].absorbed()
            for u in heads:
                out.group_of[u] = index
            units -= len(heads)
    return units


def _cut(graph: Graph, unit_of: list[int], out: Plan, limit: int) -> int:
    """Keeps the ``limit - 1`` boxes nearest the output; the rest become one box. Returns the
    boxes drawn."""
    key = [g if (g := out.group_of[u]) >= 0 else -2 - u for u in unit_of]
    inputs: dict[int, set[int]] = {}
    for n in graph.nodes:
        inputs.setdefault(key[n.id], set()).update(key[i] for i in n.inputs if key[i] != key[n.id])
    kept: dict[int, None] = {}
    queue = deque(dict.fromkeys(key[r] for r in graph.roots))
    while queue and len(kept) < limit - 1:
        b = queue.popleft()
        if b in kept:
            continue
        kept[b] = None
        queue.extend(sorted(inputs.get(b, ())))
    rest = [i for i in range(len(graph.nodes)) if key[i] not in kept]
    more = Group(rest, f"… {len(rest):,} more nodes not drawn", "", more=True)
    index = len(out.groups)
    out.groups.append(more)
    for i in rest:
        out.group_of[unit_of[i]] = index
    return len(kept) + 1


def drawing_notes(graph: Graph) -> tuple[str, ...]:
    """What the default drawing (every node, at most `MAX_DRAWN` boxes) collapses or leaves
    out; nothing for a graph that fits."""
    if len(graph.nodes) <= MAX_DRAWN:
        return ()
    return tuple(
        plan(graph, list(range(len(graph.nodes))), len(graph.nodes), MAX_DRAWN, True).notes
    )
