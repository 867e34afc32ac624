"""What ``memlab.graph`` adds when the forward refuses its inputs: a whole batch, a loader or a
mapping given where the forward takes tensors."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from memlab.graphs.args import article, describe, tensors_of
from memlab.graphs.scan import own_attributes, type_name


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
                what = article(f"{type_name(tp)} (batches not yet made)")
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
                f"({str(error).splitlines()[0][:200]}) on input {k}, "
                f"{article(type_name(tp))} of tensors ({keys}). Pass a mapping as keyword "
                "arguments, memlab.graph(model, **batch), or the tensor the forward takes: "
                "memlab.graph(model, batch['input'])."
            )
    return None


def mapping_hint(inputs: tuple[Any, ...]) -> str | None:
    """What to add to an error the forward raised on its one positional input, a mapping (a
    tokenizer's batch, a dict of tensors): a model that takes keyword arguments fails on it with
    its own error (a Hugging Face model: AttributeError: 'dict' object has no attribute 'size').
    None for other inputs."""
    if len(inputs) != 1 or not issubclass(type(inputs[0]), Mapping):
        return None
    keys = _keys(inputs[0])
    return (
        f"memlab: the forward raised this on input 1 of memlab.graph(model, *inputs), "
        f"{article(type_name(type(inputs[0])))}{f' ({keys})' if keys else ''}. If the model "
        "takes its items as keyword arguments (a Hugging Face model and its tokenizer's batch "
        "do), pass them so: memlab.graph(model, **batch)."
    )


def _keys(mapping: Any) -> str:
    """The first keys of a dict, or of a ``UserDict``'s own ``data`` (a tokenizer's
    ``BatchEncoding``), read without running the mapping's code; "" where that cannot be."""
    data = mapping if issubclass(type(mapping), dict) else dict(own_attributes(mapping)).get("data")
    if not isinstance(data, dict):  # (no user code: a dict's type answers)
        return ""
    return ", ".join(repr(k)[:40] if type(k) is str else "…" for k in list(dict.keys(data))[:5])


def add_note(e: BaseException, text: str) -> None:
    """Adds ``text`` below ``e``'s message, its type and traceback kept (PEP 678; on Python
    3.10, which has no ``add_note``, as ``__notes__``, which later tracebacks show)."""
    with contextlib.suppress(Exception):  # (a type that refuses attributes: left as it is)
        if hasattr(e, "add_note"):
            e.add_note(text)
        else:
            e.__notes__ = [*getattr(e, "__notes__", ()), text]


def meta_hint(model: Any, inputs: Any, error: BaseException) -> str | None:
    """What to add to an error a forward on ``meta`` tensors raised where it needed a value
    (``.item()``, a branch on a tensor: a Hugging Face mask builder does so): meta tensors have
    shapes and no values. None where the forward ran on no meta tensor, or failed otherwise."""
    if "meta" not in str(error):
        return None
    on_meta = any(t.is_meta for t in tensors_of(inputs)) or any(
        p.is_meta for p in model.parameters()
    )
    if not on_meta:
        return None
    return (
        "memlab: memlab.graph ran the forward on meta tensors, which have shapes but no values, "
        "and the forward (or a library it calls) read a value: a Hugging Face model reads its "
        "attention_mask's (an all-ones mask can be left out). Or draw the graph from a small "
        "input on the CPU (a batch of 1, a short sequence): its nodes are the same, and the "
        "bytes each saves grow with the input's size."
    )
