"""What ``memlab.track`` accepts, checked when it is made: an error names the argument, what it
got and what to pass, rather than a region that misreads it (``breakdown="no"`` is true; a
model passed as ``watch`` is callable, and was called as if it were a function)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from memlab.core.frames import misuse
from memlab.core.ledger import Ledger, default_ledger

#: What a region can watch: tensors, modules and optimizers.
WATCHABLE = (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)


def _what(value: Any) -> str:
    """``value`` described by its type (never by its own ``__repr__``)."""
    kind = type(value).__name__
    return f"{'an' if kind[:1] in 'aeiouAEIOU' else 'a'} {kind}"


def check_flag(name: str, value: Any) -> bool:
    """``True``/``False`` (0 and 1 too); anything else is a TypeError naming ``name``."""
    if type(value) in (bool, np.bool_) or (type(value) is int and value in (0, 1)):
        return bool(value)
    raise TypeError(f"memlab.track: {_given(name, value)}: pass True or False.")


def check_since(value: Any) -> int:
    """``since``: a ledger serial (``ledger.next_serial()``), an int ≥ 0."""
    if type(value) is not int or value < 0:
        raise TypeError(
            f"memlab.track: since must be a ledger serial, an int ≥ 0 (ledger.next_serial()), "
            f"got {type(value).__name__} {value!r:.40}; leave it out to count everything."
        )
    return value


def check_ledger(value: Any) -> Any:
    """``ledger``: a memlab Ledger, or None for the default one."""
    if value is None:
        return default_ledger()
    if isinstance(value, Ledger):
        return value
    kind = type(value)
    if kind.__qualname__ == "Ledger" and kind.__module__ == Ledger.__module__:
        raise TypeError(
            "memlab.track: ledger is a Ledger from an earlier import of memlab (its modules "
            "were removed from sys.modules and imported again): leave ledger out to use the "
            "default one, or make a new one with memlab.core.ledger.Ledger()."
        )
    raise TypeError(
        f"memlab.track: ledger must be a memlab Ledger or None, got {type(value).__name__}: "
        "leave it out to use the default one."
    )


def check_label(value: Any) -> str | None:
    if value is None or type(value) is str:
        return value
    raise TypeError(f"memlab.track: {_given('label', value)}: pass a str, or None.")


def _given(name: str, value: Any) -> str:
    """``name=value is a kind`` where the value is plain, ``name is a kind`` otherwise."""
    if type(value) in (str, int, float):
        return f"{name}={repr(value)[:60]} is {_what(value)}"
    return f"{name} is {_what(value)}"


def weak_refs(name: str, objects: Any, kinds: tuple[type, ...], what: str) -> list[Any]:
    """Weak references to ``objects`` (one of ``kinds`` alone, or an iterable of them)."""
    if type(objects) is tuple and not objects:  # (the default: at every cell)
        return []
    if issubclass(type(objects), kinds):
        objects = [objects]
    elif not isinstance(objects, Iterable) or isinstance(objects, (str, bytes)):
        raise TypeError(f"memlab.track: {name} is {_what(objects)}: pass a list of {what}.")
    refs = []
    for i, obj in enumerate(objects):
        if i == MAX_OBJECTS:
            raise _endless(name, what)
        if not issubclass(type(obj), kinds):
            raise TypeError(f"memlab.track: {name}[{i}] is {_what(obj)}: pass {what} only.")
        refs.append(weakref.ref(obj))
    return refs


#: Objects a ``watch`` or ``inputs`` gives at most: past it, an endless iterator is suspected.
MAX_OBJECTS = 1_000_000


def _endless(name: str, what: str) -> ValueError:
    return ValueError(
        f"memlab.track: {name} gave more than {MAX_OBJECTS:,} objects (an endless generator?): "
        f"pass a list of {what}."
    )


def watched(value: Any) -> Callable[[], Iterable[Any]] | list[weakref.ref[Any]]:
    """A function that returns what to watch (called at the start and at the end), or weak
    references to the tensors, modules and optimizers given. A module is callable, but it is
    watched, not called."""
    if callable(value) and not issubclass(type(value), WATCHABLE):
        fn: Callable[[], Iterable[Any]] = value
        return fn
    return weak_refs("watch", value, WATCHABLE, "tensors, modules and optimizers")


def alive(refs: list[Any]) -> list[Any]:
    """The objects ``refs`` (from `weak_refs`) still refer to."""
    return [o for o in (r() for r in refs) if o is not None]


def called(fn: Callable[[], Any]) -> Iterable[Any]:
    """What a ``watch`` function returned, if it is something to iterate over."""
    found = fn()
    if isinstance(found, Iterable) and not isinstance(found, (str, bytes)):
        if isinstance(found, list):
            return found
        listed = list(itertools.islice(found, MAX_OBJECTS + 1))
        if len(listed) > MAX_OBJECTS:
            raise _endless("the watch function", "tensors, modules and optimizers")
        return listed
    raise TypeError(
        f"memlab.track: the watch function returned {_what(found)}: return a list of tensors, "
        "modules and optimizers."
    )


def not_started(why: BaseException | None) -> RuntimeError:
    """What reading the report of a region that never started raises: memlab's own failure
    while it started, named; else (a Ctrl-C) the user's misuse."""
    if isinstance(why, Exception):
        return RuntimeError(f"measuring it could not start ({type(why).__name__}: {why})")
    return misuse("the region never started: setting it up was stopped or failed")


#: Said where a Ctrl-C came while memlab closed a region whose code had run to its end.
CLOSED_THROUGH_CTRL_C = (
    "a Ctrl-C came while memlab closed this region, after its code ran to its end: memlab "
    "finished the report first (its figures cover the whole region)"
)
