"""What ``memlab.graph`` and ``memlab.graph_of`` accept, and the errors that say what to pass.

Every error names the argument, what was received (described without running the user's
``__repr__``) and what to pass instead.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Iterator
from typing import Any

import torch

from memlab.graphs.scan import type_name

#: Containers whose tensors are unpacked (base-class methods: a subclass's overrides do not run).
_CONTAINERS = (list, tuple, dict)
_PLAIN = (int, float, complex, bool, str, bytes, type(None))
#: Tensors looked at in one output (a model returning thousands of tensors is unusual).
MAX_TENSORS = 100_000


class NoGraphError(ValueError):
    """The output has no autograd graph."""


class GraphArgumentError(TypeError):
    """``memlab.graph`` or ``memlab.graph_of`` was given something other than what it draws."""


def describe(value: Any) -> str:
    """A short description of a user's value: its kind, and its value where that is plain."""
    tp = type(value)
    if issubclass(tp, torch.Tensor):
        shape = "×".join(map(str, sizes(value))) or "scalar"
        dtype = str(value.dtype).removeprefix("torch.")
        kind = ", sparse" if value.is_sparse else ", nested" if value.is_nested else ""
        return f"a tensor ({shape}, {dtype}{kind})"
    if issubclass(tp, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        name = getattr(value, "__qualname__", None)
        return f"the function {name}" if type(name) is str else "a function"
    if issubclass(tp, torch.nn.Module):
        return f"a {type_name(tp)} module"
    if any(tp is p for p in _PLAIN):
        text = repr(value)
        return f"{'an' if type_name(tp)[0] in 'aeiou' else 'a'} {type_name(tp)} ({text[:60]})"
    for base in _CONTAINERS:
        if issubclass(tp, base):
            return f"a {type_name(tp)} of {base.__len__(value)} item(s)"
    return f"a {type_name(tp)} object"


def sizes(t: torch.Tensor) -> tuple[int | str, ...]:
    """``t``'s sizes, never an error: a nested tensor's ragged dimension as torch names it
    ("j1"), or "?" where its layout cannot say (``.shape`` raises for those)."""
    try:
        return tuple(s if type(s) is int else str(s) for s in t.shape)
    except Exception:
        pass
    out: list[int | str] = []
    for i in range(t.dim()):
        try:
            out.append(int(t.size(i)))
        except Exception:
            out.append("?")
    return tuple(out)


def not_a_module(model: Any) -> str:
    what = describe(model)
    if any(t.grad_fn is not None for t in tensors_of(model)):  # outputs, e.g. a list of losses
        fix = (
            "It holds tensors that already have a graph: draw that with memlab.graph_of(...) "
            "(lists, tuples and dicts are unpacked)."
        )
    elif callable(model):
        fix = (
            "For a function, run it with grad enabled and pass what it returns: "
            "memlab.graph_of(fn(x)) (module names are then unknown)."
        )
    else:
        fix = "Pass the model and the inputs of one forward: memlab.graph(model, x)."
    return f"memlab.graph(model, *inputs): model must be a torch.nn.Module, not {what}. {fix}"


def required_inputs(model: torch.nn.Module) -> list[str]:
    """The parameters ``model.forward`` needs that have no default (none where unknown)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except Exception:  # a forward without a signature: run it and let it say
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    kinds = (*positional, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj`` and the lists, tuples and dicts under it, each once, in order
    (an explicit stack: nesting of any depth)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [obj]
    while stack and len(out) < MAX_TENSORS:
        value = stack.pop()
        tp = type(value)
        if id(value) in seen:
            continue
        seen.add(id(value))
        if issubclass(tp, torch.Tensor):
            out.append(value)
        elif issubclass(tp, dict):
            stack.extend(reversed(list(dict.values(value))))
        elif issubclass(tp, list):
            stack.extend(reversed(list(list.__iter__(value))))
        elif issubclass(tp, tuple):
            stack.extend(reversed(list(tuple.__iter__(value))))
    return out


def output_tensors(outputs: tuple[Any, ...]) -> list[torch.Tensor]:
    """``graph_of``'s arguments as tensors: each a tensor, or a list, tuple or dict of them."""
    if not outputs:
        raise GraphArgumentError(
            "memlab.graph_of(*outputs) needs at least one tensor with a grad_fn: "
            "memlab.graph_of(loss), or memlab.graph_of(model(x))."
        )
    found: list[torch.Tensor] = []
    for k, value in enumerate(outputs, 1):
        tensors = tensors_of(value)
        if not tensors:
            tp = type(value)
            hint = (
                " For a model, memlab.graph(model, x) runs the forward and names the modules."
                if issubclass(tp, torch.nn.Module)
                else ""
            )
            holds = " holding no tensor" if issubclass(tp, _CONTAINERS) else ", not a tensor"
            raise GraphArgumentError(
                f"memlab.graph_of(*outputs): argument {k} is {describe(value)}{holds}. Pass the "
                "tensor(s) a forward returned, e.g. memlab.graph_of(loss) or "
                "memlab.graph_of(model(x)) (lists, tuples and dicts of tensors are unpacked)."
                + hint
            )
        found += tensors
    return found


def given_inputs(inputs: Any) -> list[torch.Tensor]:
    """``graph_of``'s ``inputs=``: a tensor, or a list, tuple or dict of tensors (or none)."""
    if inputs is None:
        return []
    tensors = tensors_of(inputs)
    container = next((b for b in _CONTAINERS if issubclass(type(inputs), b)), None)
    if tensors or (container is not None and container.__len__(inputs) == 0):
        return tensors
    raise GraphArgumentError(
        f"memlab.graph_of(..., inputs=...): inputs is {describe(inputs)}"
        f"{' holding no tensor' if container else ''}. Pass the tensors that exist anyway (the "
        "forward's inputs), e.g. inputs=[x], or leave inputs out."
    )


def no_grad_fn_message(t: torch.Tensor, count: int) -> str:
    """Why ``t`` (the first of ``count`` tensors given to ``graph_of``) has no graph."""
    if count == 1:
        head = f"memlab.graph_of got {describe(t)}, which"
    else:
        head = f"memlab.graph_of got {count} tensors and none has one; the first, {describe(t)},"
    if t.is_inference():
        why = (
            "was made under torch.inference_mode(), which records no graph. Run the forward "
            "with grad enabled, outside inference_mode and torch.no_grad()"
        )
    elif t.requires_grad:
        why = (
            "is a leaf: it requires grad but was not computed from anything (a parameter or an "
            "input). Pass a tensor computed from it, e.g. the output or the loss"
        )
    else:
        why = (
            "does not require grad. Run the forward with grad enabled (not under torch.no_grad() "
            "or torch.inference_mode()) and with parameters or inputs that require grad "
            "(x.requires_grad_())"
        )
    return f"The output has no grad_fn, so there is no autograd graph to draw: {head} {why}."


def no_graph_message(out: Any, tensors: list[torch.Tensor], grad: bool) -> str:
    """Why the forward run by ``memlab.graph`` gave no graph."""
    if not tensors:
        return (
            f"memlab.graph: the forward returned {describe(out)}, no tensor, so there is no "
            "autograd graph to draw. Return the output tensor(s) from forward."
        )
    if not grad:
        why = (
            "no parameter of the model and no input requires grad. Leave the parameters' "
            "requires_grad on, or call x.requires_grad_() on an input"
        )
    else:
        why = (
            "grad was off inside the forward (torch.no_grad() or torch.inference_mode() in it, "
            "or the output detached)"
        )
    return (
        f"memlab.graph: the forward returned {describe(out)} without a grad_fn, so there is no "
        f"autograd graph to draw (memlab.graph runs it with grad enabled): {why}."
    )


def packed_inputs(inputs: tuple[Any, ...], error: BaseException) -> str | None:
    """Why the forward may have refused ``inputs`` (a TypeError ``error`` raised in it): a
    DataLoader's whole batch, a list or tuple of tensors, a mapping of them (keyword
    arguments), a generator or iterator of batches, or the loader itself given where the
    tensors go; None when no input looks like that."""
    for k, value in enumerate(inputs, 1):
        tp = type(value)
        packed = issubclass(tp, (list, tuple)) and bool(tensors_of(value))
        loader = type_name(tp) == "DataLoader"
        lazy = issubclass(tp, (types.GeneratorType, Iterator)) and not issubclass(tp, torch.Tensor)
        if packed or loader or lazy:
            what = "the DataLoader itself" if loader else describe(value)
            if lazy:
                what = f"a {type_name(tp)} (batches not yet made)"
            return (
                f"memlab.graph(model, *inputs): the forward raised {type(error).__name__} "
                f"({str(error).splitlines()[0][:200]}) on input {k}, {what}. Pass the tensors "
                "the forward takes, unpacked: a DataLoader's batch is (inputs, targets), so "
                "x, y = next(iter(loader)); memlab.graph(model, x); arguments in a tuple: "
                "memlab.graph(model, *args)."
            )
        if issubclass(tp, dict) and bool(tensors_of(value)):  # its own keys, no code of its
            keys = ", ".join(repr(key)[:40] for key in list(dict.keys(value))[:5])
            return (
                f"memlab.graph(model, *inputs): the forward raised {type(error).__name__} "
                f"({str(error).splitlines()[0][:200]}) on input {k}, a {type_name(tp)} of "
                f"tensors ({keys}). Pass a mapping as keyword arguments, "
                "memlab.graph(model, **batch), or the tensor the forward takes: "
                "memlab.graph(model, batch['input'])."
            )
    return None
