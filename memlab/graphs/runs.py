"""Repeats in an annotated graph, found in linear time: the groups a big drawing collapses.

- runs of identical sibling modules (same ops in the same places below them):
  ``1 … 9999: Linear, ReLU ×4,999 more, as 0``;
- runs of identical steps along a chain of nodes (``[MulBackward0] ×9,999 more``); a step keeps
  the few nodes that hang off it alone, such as its weight's leaf and transpose;
- identical inputs of one node (``stack`` of 2,000 like tensors).

Each run's group leaves its first block out (`Group.head`), so that a drawing can show one block
node by node beside the box of its repeats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memlab.reports.units import fmt_bytes

if TYPE_CHECKING:
    from memlab.graphs.model import Graph, Node

#: A node with more consumers than this is drawn without its out-edges ("used by N nodes").
HUB = 8
#: The longest repeated block looked for (in sibling modules, or steps along a chain).
MAX_PERIOD = 8
#: Nodes hanging off one step of a chain (its weight, bias, transpose) that travel with it.
MAX_ATTACHED = 4


@dataclass
class Group:
    """Nodes drawn as one box. A run's group first leaves its first block drawn node by node
    (``head``), and takes it in too (`absorbed`) where the drawing would not fit otherwise."""

    members: list[int]
    title: str
    cluster: str  # the module whose cluster holds the box ("" for none)
    more: bool = False  # the "… N more nodes" box
    head: list[int] = field(default_factory=list)
    whole: str = ""  # the title once the head is taken in

    def absorbed(self) -> Group:
        """The group with its first block in it too."""
        return dataclasses.replace(
            self, members=self.head + self.members, head=[], title=self.whole
        )

    def saved(self, nodes: Sequence[Node]) -> int:
        return sum(nodes[i].bytes for i in self.members)

    def label(self, nodes: Sequence[Node]) -> str:
        return f"{self.title}\n{len(self.members):,} nodes · {fmt_bytes(self.saved(nodes))}"


def natural(name: str) -> tuple[tuple[int, int, str], ...]:
    return tuple((0, int(p), "") if p.isdecimal() else (1, 0, p) for p in name.split("."))


def runs(seq: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, period, repeats) of the runs of a block repeated at least twice, greedily from
    the left, the longest cover first (the shortest period on a tie)."""
    out, i, n = [], 0, len(seq)
    while i < n:
        best_p, best_k = 0, 1
        for p in range(1, min(MAX_PERIOD, (n - i) // 2) + 1):
            k = 1
            while i + (k + 1) * p <= n and all(seq[i + k * p + j] == seq[i + j] for j in range(p)):
                k += 1
            if k >= 2 and p * k > best_p * best_k:
                best_p, best_k = p, k
        if best_k >= 2:
            out.append((i, best_p, best_k))
            i += best_p * best_k
        else:
            i += 1
    return out


def consumers_of(graph: Graph) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in graph.nodes]
    for n in graph.nodes:
        for i in n.inputs:
            out[i].append(n.id)
    return out


def _interner() -> Callable[[object], int]:
    table: dict[object, int] = {}
    return lambda key: table.setdefault(key, len(table))


def module_runs(graph: Graph) -> list[Group]:
    """Runs of identical sibling modules: same ops in the same places below them."""
    own: dict[str, dict[str, int]] = {}
    members: dict[str, list[int]] = {}
    for n in graph.nodes:
        if n.module:
            ops = own.setdefault(n.module, {})
            ops[n.op] = ops.get(n.op, 0) + 1
            members.setdefault(n.module, []).append(n.id)
    children: dict[str, set[str]] = {}
    for path in list(own):
        while path:
            parent = path.rpartition(".")[0]
            siblings = children.setdefault(parent, set())
            if path in siblings:
                break  # its ancestors are known already
            siblings.add(path)
            own.setdefault(path, {})
            path = parent
    ordered = {
        p: sorted(c, key=lambda k: natural(k.rpartition(".")[2])) for p, c in children.items()
    }
    intern = _interner()
    sig: dict[str, int] = {}
    flat: list[int] = []  # the nodes, each module's below it contiguous: span[path]
    span: dict[str, tuple[int, int]] = {}
    stack = [(p, False) for p in reversed(ordered.get("", []))]
    while stack:  # depth first; a module's signature after its children's
        path, done = stack.pop()
        kids = ordered.get(path, [])
        if not done:
            span[path] = (len(flat), -1)
            flat.extend(members.get(path, []))
            stack.append((path, True))
            stack.extend((k, False) for k in reversed(kids))
            continue
        span[path] = (span[path][0], len(flat))
        parts = tuple((k.rpartition(".")[2], sig[k]) for k in kids)
        sig[path] = intern((tuple(sorted(own[path].items())), parts))
    kinds = dict(graph.module_types)
    groups = []
    for parent, kids in ordered.items():
        for start, p, k in runs([sig[c] for c in kids]):
            block = kids[start : start + p * k]
            names = ", ".join(kinds.get(c) or c.rpartition(".")[2] for c in block[:p])
            like = block[0] if p == 1 else f"{block[0]} … {block[p - 1]}"
            title = f"{block[p]} … {block[-1]}\n{names} ×{k - 1:,} more, as {like}"
            whole = f"{block[0]} … {block[-1]}\n{names} ×{k:,}"
            head = flat[span[block[0]][0] : span[block[p - 1]][1]]
            rest = flat[span[block[p]][0] : span[block[-1]][1]]
            groups.append(Group(rest, title, parent, head=head, whole=whole))
    return groups


def chain_runs(graph: Graph, consumers: list[list[int]]) -> list[Group]:
    """Runs of identical steps along chains of nodes (each step with the few nodes that hang
    off it alone, such as its weight), and identical inputs of one node."""
    nodes = graph.nodes
    hub = [len(c) > HUB for c in consumers]
    pending = [len(n.inputs) for n in nodes]
    order = [n.id for n in nodes if not n.inputs]
    for i in order:  # grows as it goes: inputs before the nodes that use them
        for c in consumers[i]:
            pending[c] -= 1
            if pending[c] == 0:
                order.append(c)
    intern = _interner()
    size: list[int | None] = [None] * len(nodes)  # nodes hanging off one step: their count
    sig = [0] * len(nodes)
    for i in order:
        ins = list(dict.fromkeys(nodes[i].inputs))
        attached = [j for j in ins if size[j] is not None]
        hubs = sum(hub[j] for j in ins)  # drawn apart, without edges: no part of a step
        sig[i] = intern((nodes[i].op, hubs, tuple(sorted(sig[j] for j in attached))))
        if len(consumers[i]) == 1 and len(attached) + hubs == len(ins):
            total = 1 + sum(size[j] or 0 for j in attached)
            size[i] = total if total <= MAX_ATTACHED else None

    def step(i: int) -> list[int]:
        out, stack = [], [i]
        while stack:
            j = stack.pop()
            out.append(j)
            stack.extend(k for k in dict.fromkeys(nodes[j].inputs) if size[k] is not None)
        return out

    spine = [size[i] is None and not hub[i] for i in range(len(nodes))]
    nxt: dict[int, int] = {}
    groups = []
    for i in range(len(nodes)):
        if not spine[i]:
            continue
        along = {j for j in nodes[i].inputs if spine[j]}
        if len(along) == 1:
            (j,) = along
            if {c for c in consumers[j] if spine[c]} == {i}:
                nxt[i] = j
        alike: dict[int, list[int]] = {}
        for j in dict.fromkeys(nodes[i].inputs):
            if size[j] is not None:
                alike.setdefault(sig[j], []).append(j)
        for same in alike.values():
            if len(same) > 2:
                title = f"inputs of {nodes[i].op} like {nodes[same[0]].op}"
                groups.append(
                    _group(
                        [[j] for j in same],
                        step,
                        f"{len(same) - 1:,} more {title}",
                        f"{len(same):,} {title}",
                        nodes,
                    )
                )
    linked = set(nxt.values())
    for s in (i for i in range(len(nodes)) if spine[i] and i not in linked):
        chain = [s]
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        for start, p, k in runs([sig[i] for i in chain]):
            block = chain[start : start + p * k]
            ops = " → ".join(nodes[i].op for i in reversed(block[:p]))
            blocks = [block[b * p : (b + 1) * p] for b in range(k)]
            groups.append(
                _group(blocks, step, f"[{ops}] ×{k - 1:,} more", f"[{ops}] ×{k:,}", nodes)
            )
    return groups


def _group(
    blocks: list[list[int]],
    step: Callable[[int], list[int]],
    title: str,
    whole: str,
    nodes: Sequence[Node],
) -> Group:
    """The group of a run's blocks (of steps), its first block as the head."""
    head = [m for i in blocks[0] for m in step(i)]
    rest = [m for b in blocks[1:] for i in b for m in step(i)]
    modules = sorted({nodes[m].module for m in head + rest if nodes[m].module}, key=natural)
    where = f"\nmodules {modules[0]} … {modules[-1]}" if len(modules) > 1 else ""
    return Group(rest, title + where, _common(modules), head=head, whole=whole + where)


def _common(paths: list[str]) -> str:
    if not paths:
        return ""
    first, last = paths[0].split("."), paths[-1].split(".")
    shared = []
    for a, b in zip(first, last, strict=False):
        if a != b:
            break
        shared.append(a)
    prefix = ".".join(shared)
    return prefix if all(p == prefix or p.startswith(prefix + ".") for p in paths) else ""
