"""Capture an autograd graph and annotate it: bytes saved per node, and the module that made it.

Module attribution: while the forward runs, global module hooks note the autograd sequence
number at each module's start and end; a node belongs to the innermost module whose interval
holds its sequence number, so functional ops inside ``forward`` belong to their module.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from memlab.core import _torch
from memlab.core.autograd import iter_nodes
from memlab.core.frames import the_users, users_traceback
from memlab.graphs.args import (
    GraphArgumentError,
    NoGraphError,
    given_inputs,
    no_grad_fn_message,
    no_graph_message,
    not_a_module,
    output_tensors,
    required_inputs,
    sizes,
    tensors_of,
)
from memlab.graphs.charge import CHECKPOINT_INPUT, Ledger
from memlab.graphs.collapse import drawing_notes
from memlab.graphs.inputs import add_note, mapping_hint, meta_hint, packed_inputs
from memlab.graphs.model import Graph, Node
from memlab.graphs.saved import op_name, storages, unreadable
from memlab.reports.units import fmt_bytes

__all__ = ["GraphArgumentError", "NoGraphError", "graph", "graph_of"]

_LEAF_SEQ = 2**64 - 1  # AccumulateGrad nodes' sequence number


@users_traceback(own=(GraphArgumentError, NoGraphError))  # the user's frames alone
def graph(model: torch.nn.Module, *inputs: Any, **kwargs: Any) -> Graph:
    """Run ``model(*inputs, **kwargs)`` with grad enabled and return its annotated graph.

    Works on any device, meta and fake tensors included (nothing is allocated on meta)."""
    if not issubclass(type(model), torch.nn.Module):
        raise GraphArgumentError(not_a_module(model))
    if not inputs and not kwargs:
        needed = required_inputs(model)
        if needed:
            raise GraphArgumentError(
                f"memlab.graph(model, *inputs) runs one forward of the model, so it needs its "
                f"inputs: {type(model).__name__}.forward takes {', '.join(needed)} and none was "
                "given. Pass them after the model: memlab.graph(model, x), or as keywords "
                f"(memlab.graph(model, {needed[0]}=x))."
            )
    names = {id(m): name for name, m in model.named_modules()}
    kinds = tuple((name, type(m).__name__) for name, m in model.named_modules())
    intervals: list[tuple[int, int, str]] = []
    with _module_intervals(names, intervals), torch.enable_grad():
        try:
            out = model(*inputs, **kwargs)
        except Exception as e:
            why = packed_inputs(inputs, e) if isinstance(e, TypeError) else None
            if why is None:  # the model's, on its input: shown without memlab's frames
                hint = mapping_hint(inputs) or meta_hint(model, (inputs, kwargs), e)
                # (its type and traceback kept: a note below)
                if hint is not None:
                    add_note(e, hint)
                the_users(e)
                raise
            # a whole batch, or the loader, where a tensor goes
            raise GraphArgumentError(why) from e
    outputs = tensors_of(out)
    if not any(t.grad_fn is not None for t in outputs):
        grad = any(p.requires_grad for p in model.parameters()) or any(
            t.requires_grad for t in tensors_of((inputs, kwargs))
        )
        raise NoGraphError(no_graph_message(out, outputs, grad))
    fixed = _storages(model.parameters(), model.buffers())
    given = _storages(tensors_of((inputs, kwargs)))
    params = {id(p): n for n, p in model.named_parameters()}
    notes = (
        ()
        if _torch.next_sequence_nr() is not None
        else ("this torch cannot tell which module made each node",)
    )
    return _build(outputs, intervals, fixed, given, params, notes, kinds)


@users_traceback()
def graph_of(*outputs: torch.Tensor, inputs: Iterable[torch.Tensor] = ()) -> Graph:
    """The annotated graph behind tensors that already have a ``grad_fn`` (lists, tuples,
    dicts and dataclasses of them are unpacked). Module names are unknown here
    (``memlab.graph`` runs the forward to learn them); leaves that require grad are the graph's
    parameters, and ``inputs`` are tensors that exist anyway."""
    return graph_of_tensors(output_tensors(outputs), inputs, "memlab.graph_of")


def graph_of_tensors(tensors: list[torch.Tensor], inputs: Any, func: str) -> Graph:
    """`graph_of` of ``tensors``, its errors naming ``func``, the function the user called."""
    given = given_inputs(inputs, func)
    without = [t for t in tensors if t.grad_fn is None]
    if len(without) == len(tensors):
        raise NoGraphError(no_grad_fn_message(without[0], len(tensors), func))
    notes = ("modules unknown: memlab.graph(model, *inputs) runs the forward to learn them",)
    return _build(tensors, [], None, _storages(given), {}, notes, ())


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


def _storages(*groups: Iterable[torch.Tensor]) -> dict[int, Any]:
    return {id(st): st for g in groups for t in g for st in (storages(t) or ())}


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
    kinds: tuple[tuple[str, str], ...],
) -> Graph:
    """``fixed``: storages of parameters and buffers (``None``: the graph's leaves);
    ``given``: storages of the forward's inputs."""
    roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
    owner = _owners(intervals)
    nodes = list(iter_nodes(roots))
    index = {id(n): i for i, n in enumerate(nodes)}
    if fixed is None:
        leaves = (getattr(n, "variable", None) for n in nodes)
        fixed = _storages([t for t in leaves if isinstance(t, torch.Tensor)])
    # Order by creation, so that a storage is charged to the earliest node that saved it.
    seqs = [_torch.sequence_nr(n) for n in nodes]
    order = sorted(range(len(nodes)), key=seqs.__getitem__)
    ledger = Ledger(fixed, given)
    opaque: list[str] = []
    built: dict[int, Node] = {}
    for i in order:
        n = nodes[i]
        leaf = getattr(n, "variable", None)
        leaf_name = None
        module = owner.get(seqs[i], "")
        if isinstance(leaf, torch.Tensor):
            leaf_name = params.get(id(leaf))
            if leaf_name is None:  # not a named parameter of the model
                kind = "parameter" if isinstance(leaf, torch.nn.Parameter) else "leaf"
                leaf_name = f"{kind} {'×'.join(map(str, sizes(leaf))) or 'scalar'}"
            else:
                module = leaf_name.rpartition(".")[0]
        if unreadable(n):
            opaque.append(op_name(n))
        total, saved = ledger.node(n)
        inputs = tuple(index[id(f)] for f, _ in n.next_functions if f is not None)
        built[i] = Node(i, op_name(n), module, total, tuple(saved), inputs, leaf_name)
    notes += _unread_notes(ledger, opaque)
    root_ids = tuple(dict.fromkeys(index[id(r)] for r in roots))
    nodes_out = tuple(built[i] for i in range(len(nodes)))
    uncounted = ledger.unread + ledger.hooked + len(opaque)
    g = Graph(nodes_out, root_ids, sum(ledger.fixed_saved.values()), notes, kinds, uncounted)
    return dataclasses.replace(g, notes=notes + drawing_notes(g))


def _unread_notes(ledger: Ledger, opaque: list[str]) -> tuple[str, ...]:
    """What the total leaves out: saved tensors without storage or packed by a hook memlab
    cannot read, and nodes that keep what they saved out of Python's reach (the total is then
    a lower bound); and how activation checkpoints were counted."""
    out: tuple[str, ...] = ()
    if ledger.frames:
        out += (
            f"{len(ledger.frames)} activation checkpoint(s): what their forward saved is "
            "recomputed in backward (rows marked recomputed, not counted); the inputs they keep "
            f"to recompute it are counted, as {CHECKPOINT_INPUT!r} on the first node of each",
        )
    if ledger.keyword_bytes():
        out += (
            f"{fmt_bytes(ledger.keyword_bytes())} more stay alive until backward as the "
            "checkpoints' keyword arguments (held by reference for the recomputation, never "
            "saved by autograd): not counted, as memlab.track counts them as other",
        )
    if ledger.hooked:
        out += (
            f"{ledger.hooked} saved tensor(s) a saved-tensors hook packed as something memlab "
            "cannot read (an offloading hook such as save_on_cpu, a program's own hook): not "
            "counted, so the total is a lower bound",
        )
    unread = ledger.unread
    if unread:
        out += (
            f"{unread} saved tensor(s) not counted: their bytes cannot be read (a tensor "
            "without storage, as an MKL-DNN one); the total is a lower bound",
        )
    if opaque:
        ops = ", ".join(sorted(set(opaque)))
        out += (
            f"{len(opaque)} node(s) whose saved tensors memlab cannot read ({ops}): not "
            "counted, so the total is a lower bound; memlab.track(breakdown=True) around the "
            "forward measures them as activations",
        )
    if "DifferentiableGraphBackward" in opaque:
        out += (
            "DifferentiableGraphBackward is a TorchScript module's graph, its ops fused into "
            "one node by the profiling executor after the first calls: memlab.graph of the "
            "module before torch.jit.script shows each op and what it saved",
        )
    return out
