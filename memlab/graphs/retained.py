"""The retained-graph finder: variables that keep an autograd graph, and what it saved, alive.

The classic leak: ``losses.append(loss)`` in a loop with grad enabled keeps every iteration's
graph and saved activations alive. ``find_retained(namespace)`` looks through the variables (and
the lists, tuples, dicts and object attributes they hold, a few levels deep) for tensors with a
``grad_fn`` and charges each variable the bytes its graphs alone keep alive: saved storages that
are neither leaves (parameters, inputs that require grad) nor held by a variable anyway, each
counted once across all variables.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass
from html import escape
from typing import Any

import torch

from memlab.core.autograd import iter_nodes
from memlab.core.frames import users_traceback
from memlab.graphs.saved import GraphFreedError, kept_for_backward, storages
from memlab.graphs.scan import Skipped, tensors_in
from memlab.reports.frame import (
    CELL,
    LEFT,
    code_cell,
    heading,
    note,
    num_cell,
    plain,
    table,
    text_cell,
)
from memlab.reports.protocol import Result
from memlab.reports.units import fmt_bytes


@dataclass(frozen=True)
class Retained:
    """One variable and the graphs it keeps alive."""

    name: str
    bytes: int
    nodes: int
    tensors: int
    example: str

    @property
    def fix(self) -> str:
        # code marked `like this`: <code> in HTML, plain in text
        if self.name.startswith(_OUT):  # IPython's output history (also `_`, `_N`)
            return (
                f"IPython's output history keeps the cell's value (also as `_{self.name[4:-1]}`): "
                "`%reset -f out` lets it go; end such a cell with `;`, or show a number "
                "(`loss.item()`)"
            )
        if self.example != self.name:  # inside a container or an object
            return (
                f"keep numbers or detached tensors in {self.name}: `loss.item()`, "
                "`out.detach()`; or run the loop under `torch.no_grad()`"
            )
        return (
            f"`{self.name} = {self.name}.detach()`, or `.item()` for a number; or compute it "
            "under `torch.no_grad()`"
        )


@dataclass(frozen=True)
class Held:
    """A container variable (a list, dict, tuple or set, e.g. a training loop's log) and the
    tensors it holds, detached or not: memory that grows if the loop adds to it each step."""

    name: str
    tensors: int
    #: Bytes of the storages its tensors keep alive, each once.
    bytes: int
    #: Bytes of the tensors' own elements: less than ``bytes`` where small views (a row of a
    #: batch's logits) keep whole storages alive.
    viewed: int

    def line(self) -> str:
        views = ""
        if self.bytes > 2 * self.viewed:
            views = (
                f" ({fmt_bytes(self.bytes - self.viewed)} of it storage kept alive by views of "
                "bigger tensors: a row `t[0]` keeps all of `t`; `.clone()` such views)"
            )
        return (
            f"{self.name}: {self.tensors} tensor(s) in it hold "
            f"{fmt_bytes(self.bytes)}{views}; if it grows each step (a log of the loop), keep "
            "numbers (`.item()`) or move them off the device (`.cpu()`)"
        )


@dataclass(frozen=True)
class RetainedReport(Result):
    """What `find_retained` found: each variable and the bytes its graphs alone keep alive."""

    css = "memlab-retained"

    items: tuple[Retained, ...]
    #: What the scan skipped and why (objects it could not read without running their code).
    notes: tuple[str, ...] = ()
    #: Variables whose tensors still carry graphs that backward has already freed (the logged
    #: ``losses.append(loss)`` of a training loop): no saved tensors, but a graph per step.
    freed: tuple[Retained, ...] = ()
    #: Containers holding tensors (a loop's log of detached ones, say), biggest first.
    held: tuple[Held, ...] = ()

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "variables": [
                {
                    "name": i.name,
                    "bytes": i.bytes,
                    "nodes": i.nodes,
                    "tensors": i.tensors,
                    "example": i.example,
                    "fix": i.fix,
                }
                for i in self.items
            ],
            "notes": list(self.notes),
            "graphs_freed": [
                {"name": i.name, "nodes": i.nodes, "tensors": i.tensors, "example": i.example}
                for i in self.freed
            ],
            "tensors_held": [
                {"name": h.name, "tensors": h.tensors, "bytes": h.bytes, "viewed": h.viewed}
                for h in self.held
            ],
        }

    def _freed_lines(self) -> list[str]:
        return [
            f"{i.name}: {i.tensors} tensor(s) still carry autograd graphs ({i.nodes} nodes, "
            f"e.g. {i.example}) whose saved tensors backward already freed: no saved tensors "
            "now, but every one kept adds its graph's nodes, and one kept before its backward "
            f"holds all its activations; keep `loss.item()` or `loss.detach()` in {i.name}"
            for i in self.freed
        ] + [h.line() for h in self.held]

    def text(self) -> str:
        notes = [f"  {plain(line)}" for line in self._freed_lines()]
        notes += [f"  note: {n}" for n in self.notes]
        if not self.items:
            return "\n".join(
                ["memlab: no variable keeps an autograd graph's saved tensors alive.", *notes]
            )
        lines = [f"memlab: {fmt_bytes(self.total)} kept alive by autograd graphs in variables"]
        for i in self.items:
            lines.append(
                f"  {i.name}: {fmt_bytes(i.bytes)} in {i.tensors} tensor(s) with a graph, "
                f"{i.nodes} nodes, e.g. {i.example}; fix: {plain(i.fix)}"
            )
        return "\n".join(lines + notes)

    def html(self) -> str:
        notes = "".join(note(plain(n)) for n in self._freed_lines())
        notes += "".join(note(n) for n in self.notes)
        if not self.items:
            return (
                heading("memlab: no variable keeps an autograd graph's saved tensors alive.")
                + notes
            )
        rows = [
            f'<td style="{LEFT}"><code>{escape(i.name)}</code></td>'
            + num_cell(i.bytes, colour=True)
            + text_cell(str(i.tensors), CELL)
            + text_cell(str(i.nodes), CELL)
            + code_cell(i.fix)
            for i in self.items
        ]
        head = ["variable", "kept alive", "tensors", "graph nodes", "fix"]
        return (
            heading(f"memlab: {fmt_bytes(self.total)} kept alive by autograd graphs")
            + table(head, rows, "memlab-retained-table")
            + notes
        )


@users_traceback()
def find_retained(
    namespace: Mapping[str, Any],
    *,
    depth: int = 3,
    skip: Container[str] = (),
    outputs: Mapping[int, Any] | None = None,
) -> RetainedReport:
    """Variables of ``namespace`` whose tensors keep autograd graphs' saved tensors alive.

    Names starting with ``_`` and names in ``skip`` (IPython's own: In, Out, ...) are ignored;
    ``outputs``, IPython's output history (cell number -> value), is looked at as ``Out[N]``
    (a cell that ends with ``loss`` keeps its graph there, and in ``_N`` and ``_``). No code of
    the namespace's objects is run (see `memlab.graphs.scan`); what cannot be read is skipped
    and counted in the report's notes."""
    if not isinstance(namespace, Mapping):
        raise TypeError(
            f"find_retained: namespace is a {type(namespace).__name__}: pass a mapping of names "
            "to values (globals(), or a notebook's get_ipython().user_ns)."
        )
    skipped = Skipped()
    plain: Any = namespace  # a dict's own items: a subclass's overrides do not run
    pairs = dict.items(plain) if issubclass(type(namespace), dict) else namespace.items()
    variables = [
        (name, value)
        for name, value in list(pairs)
        if type(name) is str and not name.startswith("_") and name not in skip
    ]
    if outputs is not None and isinstance(outputs, Mapping):
        history: Any = outputs  # (a dict's own items, as for the namespace)
        kept_out = dict.items(history) if issubclass(type(outputs), dict) else outputs.items()
        variables += [(f"{_OUT}{n}]", v) for n, v in list(kept_out) if type(n) is int]
    found: dict[str, list[tuple[str, Any]]] = {}
    held: set[int] = set()  # storages a variable holds anyway (detaching frees none of them)
    keep: list[Any] = []  # hold storages while comparing their ids
    logs = {name for name, value in variables if issubclass(type(value), _CONTAINERS)}
    holding: dict[str, tuple[int, dict[int, int], int]] = {}  # name -> tensors, storages, viewed
    for name, path, t in tensors_in(variables, depth, skipped):
        parts = storages(t)
        try:
            grad_fn = t.grad_fn
        except Exception:  # a tensor subclass's own code
            parts, grad_fn = None, None
        if parts is None:
            skipped.add("tensor")
        else:
            keep.extend(parts)
            held.update(id(st) for st in parts)
        if grad_fn is not None:
            found.setdefault(name, []).append((path, grad_fn))
        if parts is not None and name in logs and type(t) is not torch.nn.Parameter:
            count, kept, viewed = holding.get(name, (0, {}, 0))
            kept.update((id(st), st.nbytes()) for st in parts)
            holding[name] = (count + 1, kept, viewed + t.numel() * t.element_size())
    charged: set[int] = set()
    frames: dict[int, Any] = {}  # activation checkpoints whose inputs were counted
    items, freed = [], []
    for name, graphs in found.items():
        nodes = list(iter_nodes(g for _, g in graphs))
        leaves: set[int] = set()
        # a model's parameters are held anyway; another leaf only the graph holds (made
        # inline: `randn(..., requires_grad=True).sin()`) is the graph's, freed with it
        for node in nodes:
            leaf = getattr(node, "variable", None)
            if isinstance(leaf, torch.nn.Parameter):
                parts = storages(leaf) or ()
                keep.extend(parts)
                leaves.update(id(st) for st in parts)
        total, released = 0, False
        for node in nodes:
            try:
                saved = [t if t is None else storages(t) for t in kept_for_backward(node, frames)]
            except GraphFreedError:
                released = True  # backward already released this node's saved tensors
                continue
            except Exception:
                skipped.add("node")
                continue
            for parts in saved:
                if parts is None:
                    skipped.add("tensor")
                    continue
                for st in parts:
                    key = id(st)
                    keep.append(st)
                    if key in held or key in leaves or key in charged:
                        continue
                    charged.add(key)
                    total += st.nbytes()
        found_here = Retained(name, total, len(nodes), len(graphs), graphs[0][0])
        if total:
            items.append(found_here)
        elif released:
            freed.append(found_here)
    items.sort(key=lambda i: -i.bytes)
    logged = [
        Held(name, count, sum(kept.values()), viewed)
        for name, (count, kept, viewed) in holding.items()
        if count >= 2 and name not in {i.name for i in items}
    ]
    logged.sort(key=lambda h: -h.bytes)
    return RetainedReport(tuple(items), skipped.notes(), tuple(freed), tuple(logged[:5]))


#: How a value of the output history is named (``Out[2]``).
_OUT = "Out["
#: Variables that may be a loop's log: the built-in containers.
_CONTAINERS = (list, tuple, dict, set)
