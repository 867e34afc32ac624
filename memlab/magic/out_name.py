"""``-o NAME``: the names a magic may store its result in, and the storing, which never takes a
name the session needs (IPython's, Python's builtins, a module, memlab's own) nor a value the
cell itself bound there."""

from __future__ import annotations

import builtins
import functools
import keyword
import re
import types
import unicodedata
from typing import Any

from IPython.core.error import UsageError

from memlab.core.frames import memlabs


@functools.lru_cache(maxsize=256)
def variable_name(text: str, magic: str) -> str:
    """``text`` as the name Python will look up (identifiers are NFKC-normalised: a typed ``µ``
    is ``μ``), or a UsageError naming the magic. A name the session itself needs is refused:
    IPython's own (``get_ipython``, which every magic line is rewritten to call; ``In``,
    ``Out``, ``exit``, the output history ``_``, ``_3``, ``_i3``) and Python's builtins
    (``-o print`` would break every later ``print``)."""
    name = unicodedata.normalize("NFKC", text)
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UsageError(f"{magic}: -o needs a Python variable name, not {text!r}.")
    what = _reserved(name)
    if what:
        raise UsageError(
            f"{magic}: -o {text} would replace {what} in your session; pick another name "
            "(for example -o report)."
        )
    return name


def free_for(name: str | None, ns: dict[str, Any], magic: str) -> None:
    """``-o NAME`` where NAME holds a module (``-o torch`` would break every later
    ``torch.ones``) or one of memlab's own functions and classes (``-o track``): a UsageError.
    Any other value of the user's (an earlier report among them) may be replaced."""
    value = ns.get(name) if name else None
    if isinstance(value, types.ModuleType):
        what = f"the module {value.__name__!r}"
    elif isinstance(value, (type, types.FunctionType)) and memlabs(value):
        what = f"memlab's {value.__qualname__!r}"
    else:
        return
    raise UsageError(
        f"{magic}: -o {name} would replace your {name!r}, which is bound to {what}; pick "
        "another name (for example -o report)."
    )


UNBOUND = object()


def bound(name: str | None, ns: dict[str, Any]) -> Any:
    """What ``-o NAME`` holds before the cell runs (a marker where it is unbound)."""
    return ns.get(name, UNBOUND) if name else UNBOUND


def store(name: str | None, ns: dict[str, Any], value: Any, before: Any, magic: str) -> None:
    """``-o NAME``: ``value`` stored in NAME, unless the cell itself bound (or deleted) NAME
    since `bound` read it: the cell's own value wins, and the magic says so."""
    if name and ns.get(name, UNBOUND) is not before:
        print(
            f"memlab: {magic} -o {name}: the cell bound {name!r} itself, which keeps the cell's "
            "value; the report was not stored (pick another name, for example -o report)."
        )
    elif name:
        ns[name] = value


_IPYTHON_NAMES = frozenset({"get_ipython", "In", "Out", "exit", "quit", "_ih", "_oh", "_dh"})
_HISTORY = re.compile(r"_+|_i+|_i?\d+")


def _reserved(name: str) -> str | None:
    if name in _IPYTHON_NAMES or _HISTORY.fullmatch(name):
        return f"IPython's own {name!r}"
    if name in vars(builtins):
        return f"Python's builtin {name!r}"
    if len(name) > 4 and name.startswith("__") and name.endswith("__"):
        return f"Python's own {name!r}"  # (__builtins__, __name__: a module's own names)
    return None
