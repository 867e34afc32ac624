"""The retained-graph finder: variables that keep an autograd graph, and what it saved, alive.

The classic leak: ``losses.append(loss)`` in a loop with grad enabled keeps every iteration's
graph and saved activations alive. ``find_retained(namespace)`` looks through the variables (and
the lists, tuples, dicts and object attributes they hold, a few levels deep) for tensors with a
``grad_fn`` and charges each variable the bytes its graphs alone keep alive: saved storages that
are neither leaves (parameters, inputs that require grad) nor held by a variable anyway, each
counted once across all variables.
"""

from __future__ import annotations

import types
from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass
from html import escape
from typing import Any

import torch

from memlab.core.autograd import iter_nodes
from memlab.graphs.saved import GraphFreedError, saved_tensors
from memlab.reports.frame import CELL, LEFT, heading, num_cell, table, text_cell
from memlab.reports.protocol import Result
from memlab.reports.units import fmt_bytes

MAX_ITEMS = 10_000
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


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
        if self.example != self.name:  # inside a container or an object
            return (
                f"keep numbers or detached tensors in {self.name} (`loss.item()`, "
                "`out.detach()`), or run the loop under `torch.no_grad()` / "
                "`torch.inference_mode()`"
            )
        return (
            f"`{self.name} = {self.name}.detach()` (or `.item()` for a number), or compute it "
            "under `torch.no_grad()` / `torch.inference_mode()`"
        )


@dataclass(frozen=True)
class RetainedReport(Result):
    """What `find_retained` found: each variable and the bytes its graphs alone keep alive."""

    css = "memlab-retained"

    items: tuple[Retained, ...]

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
        }

    def text(self) -> str:
        if not self.items:
            return "memlab: no variable keeps an autograd graph's saved tensors alive."
        lines = [f"memlab: {fmt_bytes(self.total)} kept alive by autograd graphs in variables"]
        for i in self.items:
            lines.append(
                f"  {i.name}: {fmt_bytes(i.bytes)} ({i.tensors} tensor(s) with a graph, "
                f"{i.nodes} nodes, e.g. {i.example}); fix: {i.fix}"
            )
        return "\n".join(lines)

    def html(self) -> str:
        if not self.items:
            return heading(self.text())
        rows = [
            f'<td style="{LEFT}"><code>{escape(i.name)}</code></td>'
            + num_cell(i.bytes, colour=True)
            + text_cell(str(i.tensors), CELL)
            + text_cell(str(i.nodes), CELL)
            + text_cell(i.fix)
            for i in self.items
        ]
        head = ["variable", "kept alive", "tensors", "graph nodes", "fix"]
        return heading(f"memlab: {fmt_bytes(self.total)} kept alive by autograd graphs") + table(
            head, rows, "memlab-retained-table"
        )


def _walk(value: Any, path: str, depth: int, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """(path, tensor) for every tensor under ``value``, ``depth`` levels into containers and
    object attributes; each object visited once."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if depth <= 0 or isinstance(value, (str, bytes, int, float, bool, type(None), *_OPAQUE)):
        return
    if isinstance(value, dict):
        for k, v in list(value.items())[:MAX_ITEMS]:
            yield from _walk(v, f"{path}[{k!r}]", depth - 1, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(list(value)[:MAX_ITEMS]):
            yield from _walk(v, f"{path}[{i}]", depth - 1, seen)
    elif isinstance(getattr(value, "__dict__", None), dict):
        for k, v in list(vars(value).items())[:MAX_ITEMS]:
            if k not in ("_parameters", "_buffers"):
                yield from _walk(v, f"{path}.{k}", depth - 1, seen)


def find_retained(
    namespace: Mapping[str, Any], *, depth: int = 3, skip: Container[str] = ()
) -> RetainedReport:
    """Variables of ``namespace`` whose tensors keep autograd graphs' saved tensors alive.

    Names starting with ``_`` and names in ``skip`` (IPython's own: In, Out, ...) are ignored."""
    found: dict[str, list[tuple[str, torch.Tensor]]] = {}
    held: set[int] = set()  # storages a variable holds anyway (detaching frees none of them)
    keep: list[Any] = []  # hold storages while comparing their ids
    seen: set[int] = set()
    for name, value in list(namespace.items()):
        if name.startswith("_") or name in skip:
            continue
        for path, t in _walk(value, name, depth, seen):
            st = t.untyped_storage()
            keep.append(st)
            held.add(id(st))
            if t.grad_fn is not None:
                found.setdefault(name, []).append((path, t))
    charged: set[int] = set()
    items = []
    for name, tensors in found.items():
        nodes = list(iter_nodes(t.grad_fn for _, t in tensors))
        leaves = set()
        for node in nodes:
            leaf = getattr(node, "variable", None)
            if isinstance(leaf, torch.Tensor):
                st = leaf.untyped_storage()
                keep.append(st)
                leaves.add(id(st))
        total = 0
        for node in nodes:
            try:
                for _, t in saved_tensors(node):
                    st = t.untyped_storage()
                    key = id(st)
                    keep.append(st)
                    if key in held or key in leaves or key in charged:
                        continue
                    charged.add(key)
                    total += st.nbytes()
            except GraphFreedError:
                continue  # backward already released this node's saved tensors
        if total:
            items.append(Retained(name, total, len(nodes), len(tensors), tensors[0][0]))
    items.sort(key=lambda i: -i.bytes)
    return RetainedReport(tuple(items))
