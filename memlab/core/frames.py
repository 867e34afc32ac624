"""The user's traceback without memlab in it: an error raised by the user's code (a cell, a
forward, a loss, a ``step_fn``) shows the user's lines and the code they called, as it would
without memlab, whichever front end ran it (``%%gpumem``, `memlab.whatif.run`, ``estimate``)."""

from __future__ import annotations

import contextlib
import dis
import functools
import itertools
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import ParamSpec, TypeVar

import torch

_MEMLAB = str(Path(__file__).parents[1])  # the memlab package
#: Where library code lives (the standard library, installed packages).
_LIBRARIES = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)
#: The standard library's: frames there that memlab called (a context manager it entered, a
#: thread it waited for) are not the user's. (A package's are: the user's model may be one.)
_STDLIB = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})
_PACKAGES = ("site-packages", "dist-packages")  # (inside the standard library's folder, often)


def _stdlib(name: str) -> bool:
    return name.startswith(_STDLIB) and not any(p in name for p in _PACKAGES)


#: PyTorch's own frames between an op and a dispatch or function mode: there only because
#: memlab's mode is (the estimator's device redirection is a function mode).
_PLUMBING = tuple(
    str(Path(*parts))
    for parts in (
        ("torch", "_compile.py"),
        ("torch", "_dynamo", "eval_frame.py"),
        ("torch", "_dynamo", "external_utils.py"),
        ("torch", "_ops.py"),
        ("torch", "overrides.py"),
        ("torch", "utils", "_device.py"),
        ("torch", "utils", "_python_dispatch.py"),
    )
)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def _file(tb: TracebackType) -> str:
    name = tb.tb_frame.f_code.co_filename
    if name[:1] == "<" and str(tb.tb_frame.f_globals.get("__name__", ""))[:7] == "memlab.":
        return f"{_MEMLAB}/{name}"  # (made from a string in memlab's module: a dataclass's init)
    return name


def _entries(e: BaseException) -> list[TracebackType]:
    entries: list[TracebackType] = []
    tb = e.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    return entries


def without_memlab(e: BaseException) -> BaseException:
    """``e`` with memlab's frames taken out of its traceback, with the standard library's frames
    memlab called and PyTorch's dispatch plumbing that leads into memlab's mode; a package's
    (the user's Hugging Face model that memlab called) stay. Returns ``e`` (changed in place,
    as ``with_traceback`` does)."""
    entries = _entries(e)
    drop: set[int] = set()
    called_by_memlab = False
    for i, t in enumerate(entries):
        name = _file(t)
        if name.startswith(_MEMLAB):
            drop.add(i)
            called_by_memlab = True
        elif called_by_memlab and (_stdlib(name) or name.endswith(_PLUMBING)):
            drop.add(i)  # (the op memlab's dispatch mode called on, as the user's call went)
        else:
            called_by_memlab = False  # the user's code again (the cell, or what it called)
    if not drop:
        return e
    for i in range(len(entries) - 1, -1, -1):  # plumbing that leads into a dropped frame
        if i not in drop and i + 1 in drop and _file(entries[i]).endswith(_PLUMBING):
            drop.add(i)
    kept = [t for i, t in enumerate(entries) if i not in drop]
    for a, b in itertools.pairwise(kept):
        a.tb_next = b
    if kept:
        kept[-1].tb_next = None
    return e.with_traceback(kept[0] if kept else None)


def through_users_code(e: BaseException) -> bool:
    """Whether ``e`` was raised in, or passed through, code that is neither memlab's nor a
    library's: the user's."""
    return any(not _file(t).startswith((_MEMLAB, *_LIBRARIES)) for t in _entries(e))


#: Set on an exception that the user's code or input raised, even through library code alone
#: (a model of PyTorch's layers refusing a shape): `users_traceback` strips memlab's frames.
_USERS = "_memlab_users"


def the_users(e: BaseException) -> None:
    """Marks ``e`` as raised by what the user gave (their model on their input)."""
    with contextlib.suppress(Exception):  # (a type that refuses attributes: left as it is)
        setattr(e, _USERS, True)


def misuse(message: str) -> RuntimeError:
    """The RuntimeError memlab raises for a call out of order (a region entered twice, its report
    read while it is open), marked the user's (`the_users`): said without memlab's frames."""
    e = RuntimeError(message)
    the_users(e)
    return e


def users_unless_memlab_s(e: BaseException) -> None:
    """Marks ``e``, raised by what memlab called of the user's (their model, their step), as
    the user's (`the_users`), unless memlab's own code raised it (a bug, kept to be reported)."""
    if not raised_by_memlab(e):
        the_users(e)


def chain_without_memlab(e: BaseException) -> None:
    """``e`` and the errors it was raised from, without memlab's frames."""
    seen: set[int] = set()
    link: BaseException | None = e
    while link is not None and id(link) not in seen and len(seen) < 16:
        seen.add(id(link))
        without_memlab(link)
        link = link.__cause__ or link.__context__


_TORCH = str(Path(torch.__file__).parent)


def through_torch_alone(e: BaseException) -> bool:
    """Whether ``e`` passed through no code but PyTorch's and memlab's (not the user's, nor a
    library model's such as transformers')."""
    return all(_file(t).startswith((_TORCH, _MEMLAB)) for t in _entries(e))


def raised_by_memlab(e: BaseException) -> bool:
    """Whether the innermost frame of ``e``'s traceback is memlab's own code."""
    entries = _entries(e)
    return bool(entries) and _file(entries[-1]).startswith(_MEMLAB)


def message_of(e: BaseException) -> str:
    """``str(e)``, or a placeholder where the error's own ``__str__`` raises."""
    try:
        return str(e)
    except Exception:
        return "(its message could not be read)"


def described(e: BaseException) -> str:
    """``Kind: message`` of ``e`` (`message_of`), or its kind alone without a message."""
    text = message_of(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


_RAISE = dis.opmap["RAISE_VARARGS"]


#: What a refused argument is raised as (their subclasses too: DeviceError, WhatIfError, ...).
_REFUSALS = (TypeError, ValueError, OSError)


def said_by_memlab(e: BaseException) -> bool:
    """Whether memlab refused an argument with ``e``: a ``raise`` statement of memlab's own of
    a TypeError, ValueError or OSError; where it was raised from another error, that one came
    straight from what the raising code called (``torch.device`` refusing a string), not from
    deeper in memlab. An error Python raised inside memlab's code, an ``assert``, an invariant
    memlab checks (a RuntimeError) or a conversion of an error from memlab's own code may be a
    bug of memlab's: not this. A refusal raised ``from None`` has looked at what failed and
    found the fault in the argument (a field of a file that torch never writes so): the error
    it replaced is neither shown nor asked about."""
    entries = _entries(e)
    if not entries or not isinstance(e, _REFUSALS):
        return False
    before = e.__cause__ if e.__suppress_context__ else e.__context__
    if before is not None and any(_file(t).startswith(_MEMLAB) for t in _entries(before)[1:]):
        return False
    tb = entries[-1]
    code = tb.tb_frame.f_code.co_code
    at = tb.tb_lasti
    return (
        _file(tb).startswith(_MEMLAB)
        and 0 <= at < len(code) - 1
        and code[at] == _RAISE
        and code[at + 1] > 0  # (``raise X``, ``raise X from Y``; a bare ``raise`` passes it on)
    )


def users_traceback(
    own: tuple[type[BaseException], ...] = (),
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A front end's decorator: what the user's code raised inside it (or one of memlab's
    ``own`` errors, or an error memlab raised on purpose to say what to pass: `said_by_memlab`)
    leaves it without memlab's frames, nor those of the errors it was raised from, as does a
    Ctrl-C. Anything else (a bug of memlab's) keeps them, to be reported."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def front(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except BaseException as e:  # (SystemExit, GeneratorExit, a user's own kind too)
                if (
                    isinstance(e, (KeyboardInterrupt, *own))  # a Ctrl-C, wherever it landed
                    or through_users_code(e)
                    or getattr(e, _USERS, False)
                    or said_by_memlab(e)
                ):
                    the_users(e)  # (a front end around this one strips what it adds too)
                    chain_without_memlab(e)
                raise  # a bare raise adds no frame of this one's

        return front

    return decorate


def users_init(cls: type[T]) -> type[T]:
    """A class decorator (above ``@dataclass``): its construction refuses an argument as a front
    end does (`users_traceback`), without the dataclass's generated ``__init__`` or memlab's
    ``__post_init__`` in the user's traceback."""
    setattr(cls, "__init__", users_traceback()(cls.__init__))  # noqa: B010  (mypy: no assigning a method)
    return cls


def memlabs(value: object) -> bool:
    """Whether ``value`` (a function, a class, a hook) is defined in memlab's own code."""
    return str(getattr(value, "__module__", "")).partition(".")[0] == "memlab"
