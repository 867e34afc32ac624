"""Capture an autograd graph and annotate it: bytes saved per node, and the module that made it.

Module attribution: while the forward runs, global module hooks note the autograd sequence
number at each module's start and end; a node belongs to the innermost module whose interval
holds its sequence number, so functional ops inside ``forward`` belong to their module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from memlab.core import _torch
from memlab.core.autograd import iter_nodes
from memlab.graphs.model import Graph, Node, Saved
from memlab.graphs.saved import saved_tensors

_LEAF_SEQ = 2**64 - 1  # AccumulateGrad nodes' sequence number


class NoGraphError(ValueError):
    """The output has no autograd graph."""


def graph(model: torch.nn.Module, *inputs: Any, **kwargs: Any) -> Graph:
    """Run ``model(*inputs, **kwargs)`` with grad enabled and return its annotated graph.

    Works on any device, meta and fake tensors included (nothing is allocated on meta)."""
    names = {id(m): name for name, m in model.named_modules()}
    intervals: list[tuple[int, int, str]] = []
    with _module_intervals(names, intervals), torch.enable_grad():
        out = model(*inputs, **kwargs)
    fixed = _storages(model.parameters(), model.buffers())
    given = _storages(_tensors(inputs), _tensors(kwargs))
    params = {id(p): n for n, p in model.named_parameters()}
    notes = (
        ()
        if _torch.next_sequence_nr() is not None
        else ("this torch cannot tell which module made each node",)
    )
    return _build(_tensors(out), intervals, fixed, given, params, notes)


def graph_of(*outputs: torch.Tensor, inputs: Iterable[torch.Tensor] = ()) -> Graph:
    """The annotated graph behind tensors that already have a ``grad_fn``. Module names are
    unknown here (``memlab.graph`` runs the forward to learn them); leaves that require grad are
    the graph's parameters, and ``inputs`` are tensors that exist anyway."""
    notes = ("modules unknown: memlab.graph(model, *inputs) runs the forward to learn them",)
    return _build(list(outputs), [], None, _storages(inputs), {}, notes)


@contextlib.contextmanager
def _module_intervals(names: dict[int, str], out: list[tuple[int, int, str]]) -> Iterator[None]:
    if _torch.next_sequence_nr() is None:
        yield
        return
    from torch.nn.modules import module as nn_module

    stack: list[int] = []

    def pre(module: torch.nn.Module, args: Any) -> None:
        stack.append(_torch.next_sequence_nr() or 0)

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        start = stack.pop() if stack else 0
        out.append(
            (start, _torch.next_sequence_nr() or 0, names.get(id(module), type(module).__name__))
        )

    handles = (
        nn_module.register_module_forward_pre_hook(pre),
        nn_module.register_module_forward_hook(post, always_call=True),
    )
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _storages(*groups: Iterable[torch.Tensor]) -> dict[int, Any]:
    return {id(st): st for g in groups for t in g if (st := t.untyped_storage()) is not None}


def _owners(intervals: list[tuple[int, int, str]]) -> dict[int, str]:
    """Sequence number -> innermost module. Inner modules finish first, so painting intervals in
    the order they ended leaves each number with its innermost module."""
    owner: dict[int, str] = {}
    for start, end, name in intervals:
        for seq in range(start, end):
            owner.setdefault(seq, name)
    return owner


def _build(
    outputs: list[torch.Tensor],
    intervals: list[tuple[int, int, str]],
    fixed: dict[int, Any] | None,
    given: dict[int, Any],
    params: dict[int, str],
    notes: tuple[str, ...],
) -> Graph:
    """``fixed``: storages of parameters and buffers (``None``: the graph's leaves);
    ``given``: storages of the forward's inputs."""
    roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
    if not roots:
        raise NoGraphError(
            "The output has no grad_fn, so there is no autograd graph to draw. Run the forward "
            "with grad enabled (not under torch.no_grad() or torch.inference_mode()) and with "
            "parameters or inputs that require grad."
        )
    owner = _owners(intervals)
    nodes = list(iter_nodes(roots))
    index = {id(n): i for i, n in enumerate(nodes)}
    if fixed is None:
        leaves = (getattr(n, "variable", None) for n in nodes)
        fixed = _storages([t for t in leaves if isinstance(t, torch.Tensor)])
    # Order by creation, so that a storage is charged to the earliest node that saved it.
    order = sorted(range(len(nodes)), key=lambda i: _torch.sequence_nr(nodes[i]))
    charged: set[int] = set()
    fixed_saved: dict[int, int] = {}
    keep: list[Any] = []
    built: dict[int, Node] = {}
    for i in order:
        n = nodes[i]
        seq = _torch.sequence_nr(n)
        leaf = getattr(n, "variable", None)
        leaf_name = None
        module = owner.get(seq, "")
        if isinstance(leaf, torch.Tensor):
            leaf_name = params.get(id(leaf))
            if leaf_name is None:  # not a named parameter of the model
                kind = "parameter" if isinstance(leaf, torch.nn.Parameter) else "leaf"
                leaf_name = f"{kind} {'×'.join(map(str, leaf.shape)) or 'scalar'}"
            else:
                module = leaf_name.rpartition(".")[0]
        saved, total = [], 0
        for attr, t in saved_tensors(n):
            st = t.untyped_storage()
            keep.append(st)
            key = id(st)
            if key in fixed:
                kind = "parameter"
                fixed_saved[key] = st.nbytes()
            elif key in given:
                kind = "input"
            elif key in charged:
                kind = "shared"
            else:
                charged.add(key)
                kind = "activation"
                total += st.nbytes()
            saved.append(
                Saved(attr, tuple(t.shape), str(t.dtype).removeprefix("torch."), st.nbytes(), kind)
            )
        inputs = tuple(index[id(f)] for f, _ in n.next_functions if f is not None)
        built[i] = Node(i, type(n).__name__, module, total, tuple(saved), inputs, leaf_name)
    root_ids = tuple(dict.fromkeys(index[id(r)] for r in roots))
    nodes_out = tuple(built[i] for i in range(len(nodes)))
    return Graph(nodes_out, root_ids, sum(fixed_saved.values()), notes)
