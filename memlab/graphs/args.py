"""What ``memlab.graph`` and ``memlab.graph_of`` accept, and the errors that say what to pass.

Every error names the argument, what was received (described without running the user's
``__repr__``) and what to pass instead.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any

import torch

from memlab.graphs.scan import own_attributes, type_name

#: Containers whose tensors are unpacked (base-class methods: a subclass's overrides do not run),
#: and so are a dataclass instance's fields (read from the instance itself: `fields_of`).
_CONTAINERS = (list, tuple, dict)
#: How the errors say what is unpacked.
UNPACKED = "lists, tuples, dicts and dataclasses of tensors are unpacked"
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
        return article(f"{type_name(tp)} module")
    if any(tp is p for p in _PLAIN):
        return article(f"{type_name(tp)} ({repr(value)[:60]})")
    for base in _CONTAINERS:
        if issubclass(tp, base):
            return article(f"{type_name(tp)} of {base.__len__(value)} item(s)")
    return article(f"{type_name(tp)} object")


def article(words: str) -> str:
    """``words`` after their indefinite article: "an Out object", "a tensor"."""
    return f"{'an' if words[:1].lower() in 'aeiou' else 'a'} {words}"


def fields_of(value: Any) -> dict[str, Any] | None:
    """A dataclass instance's fields by name, in field order, read from the instance itself (no
    property or ``__getattr__`` of its class runs); None for what is not a dataclass instance.
    A forward may return one (``Out(logits=...)``), as Hugging Face's ``ModelOutput`` is, though
    that one is a dict too."""
    tp = type(value)
    if not dataclasses.is_dataclass(tp):
        return None
    try:
        names = [f.name for f in dataclasses.fields(tp)]
    except Exception:  # a class whose dataclass record is not the dataclasses module's
        return None
    own = {k: v for k, v in own_attributes(value) if type(k) is str}
    return {n: own[n] for n in names if n in own}


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
            f"({UNPACKED})."
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
    """Every tensor in ``obj`` and the lists, tuples, dicts and dataclass instances under it,
    each once, in order (an explicit stack: nesting of any depth)."""
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
        else:
            stack.extend(reversed((fields_of(value) or {}).values()))
    return out


def output_tensors(
    outputs: tuple[Any, ...], call: str = "memlab.graph_of(*outputs)", names: tuple[str, ...] = ()
) -> list[torch.Tensor]:
    """The arguments of ``call`` (as its errors name it; ``names``: each argument's name, else
    "argument k") as tensors: each a tensor, or a list, tuple, dict or dataclass of them."""
    func = call.partition("(")[0]
    if not outputs:
        raise GraphArgumentError(
            f"{call} needs at least one tensor with a grad_fn: {func}(loss), or {func}(model(x))."
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
            packed = issubclass(tp, _CONTAINERS) or fields_of(value) is not None
            holds = " holding no tensor" if packed else ", not a tensor"
            name = names[k - 1] if k <= len(names) else f"argument {k}"
            raise GraphArgumentError(
                f"{call}: {name} is {describe(value)}{holds}. Pass the tensor(s) a forward "
                f"returned, e.g. {func}(loss) or {func}(model(x)) ({UNPACKED})." + hint
            )
        found += tensors
    return found


def given_inputs(inputs: Any, func: str = "memlab.graph_of") -> list[torch.Tensor]:
    """``inputs=`` of ``func`` (``graph_of``, ``make_dot``): a tensor, or a list, tuple or dict
    of tensors (or none)."""
    if inputs is None:
        return []
    tensors = tensors_of(inputs)
    container = next((b for b in _CONTAINERS if issubclass(type(inputs), b)), None)
    if tensors or (container is not None and container.__len__(inputs) == 0):
        return tensors
    raise GraphArgumentError(
        f"{func}(..., inputs=...): inputs is {describe(inputs)}"
        f"{' holding no tensor' if container else ''}. Pass the tensors that exist anyway (the "
        "forward's inputs), e.g. inputs=[x], or leave inputs out."
    )


def no_grad_fn_message(t: torch.Tensor, count: int, func: str = "memlab.graph_of") -> str:
    """Why ``t`` (the first of ``count`` tensors given to ``func``) has no graph."""
    if count == 1:
        head = f"{func} got {describe(t)}, which"
    else:
        head = f"{func} got {count} tensors and none has one; the first, {describe(t)},"
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
            "or the output detached), or the forward runs a reentrant checkpoint "
            "(torch.utils.checkpoint with use_reentrant=True) on inputs that do not require "
            "grad, which records no graph through it: pass use_reentrant=False, or call "
            "x.requires_grad_() on its input"
        )
    return (
        f"memlab.graph: the forward returned {describe(out)} without a grad_fn, so there is no "
        f"autograd graph to draw (memlab.graph runs it with grad enabled): {why}."
    )
