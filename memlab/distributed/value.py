"""Rank 0's return value, brought home to `launch`'s caller as JSON, as it was returned.

The value goes from the rank's process to the caller's through a file, as JSON: the caller
never unpickles what another process wrote. JSON holds None, bools, ints, floats, strings, lists
and dicts with string keys exactly; a `RankTable` travels as its ``to_dict()`` and is rebuilt
where it stood in the value, found by its path. JSON would change anything else (a tuple comes
back a list, an int key a string, a numpy float a float, a tensor not at all): such a value is
refused on the rank, naming where it sits and what to return instead, rather than coming home
different from what ``fn`` returned.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memlab.distributed.table import RankTable

ACCEPTED = (
    "None, True/False, int, float, str, lists and dicts with str keys, with RankTables "
    "(memlab.distributed.gather) anywhere in them"
)
#: Exactly these types come back from JSON as they went (subclasses do not: an IntEnum, a
#: numpy float, come back as the plain int or float).
_EXACT = (bool, int, float, str, type(None))

Where = list[str | int]


class UnsendableError(TypeError):
    """Rank 0's value holds something JSON would not bring back as it was."""


def _where(path: Where) -> str:
    return "the value" + "".join(f"[{k!r}]" for k in path) if path else "the value itself"


def _hint(v: Any) -> str:
    if isinstance(v, (tuple, set, frozenset)):
        return f"return a list instead (list(...)) of the {type(v).__name__}"
    if callable(getattr(v, "item", None)) and getattr(v, "ndim", 0) == 0:  # a numpy scalar
        return "return v.item() (the plain Python number)"
    if callable(getattr(v, "tolist", None)):
        return "return v.tolist() (a tensor's or an array's numbers, as lists)"
    return f"return its fields as a dict of the types above, not the {type(v).__name__}"


def _plain(v: Any, path: Where, tables: list[Where]) -> Any:
    """``v`` as JSON-ready data; the paths of the RankTables in it go to ``tables``."""
    if isinstance(v, RankTable):
        tables.append(path)
        return v.to_dict()
    if type(v) in _EXACT:
        return v
    if type(v) is list:
        return [_plain(x, [*path, i], tables) for i, x in enumerate(v)]
    if type(v) is dict:
        for k in v:
            if type(k) is not str:
                raise UnsendableError(
                    f"{_where(path)} has the key {k!r:.40} ({type(k).__name__}), which JSON "
                    f"brings back as the string {str(k)!r:.40}: use str keys"
                )
        return {k: _plain(x, [*path, k], tables) for k, x in v.items()}
    raise UnsendableError(f"{_where(path)} is a {type(v).__name__}: {_hint(v)}")


def encode(value: Any) -> str:
    """``value`` as JSON text, or `UnsendableError` saying what in it JSON would change."""
    tables: list[Where] = []
    try:
        plain = _plain(value, [], tables)
    except RecursionError:
        raise UnsendableError("the value is nested too deep, or holds itself") from None
    return json.dumps({"value": plain, "tables": tables})


def decode(text: str) -> Any:
    """The value `encode` wrote, its RankTables rebuilt."""
    d = json.loads(text)
    value = d["value"]
    for path in d["tables"]:
        if not path:
            return RankTable.from_dict(value)
        parent = value
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = RankTable.from_dict(parent[path[-1]])
    return value


def refused(reason: str) -> TypeError:
    """The caller's error for a value that could not be sent: ``fn`` itself returned."""
    return TypeError(
        f"rank 0's fn returned, but its value cannot come back to this process: {reason}. "
        f"launch brings the value home as JSON, unchanged, so it takes {ACCEPTED}."
    )


def send(out: str, value: Any) -> None:
    """Rank 0's value to the caller; one JSON would change is not fn's error (fn returned, and
    the other ranks carry on): why it was refused goes beside it, for the caller to raise."""
    try:
        text = encode(value)
    except UnsendableError as e:
        Path(f"{out}.unsendable").write_text(str(e))
        return
    Path(out).write_text(text)


def received(out: str) -> Any:
    unsent = Path(f"{out}.unsendable")
    if unsent.exists():
        raise refused(unsent.read_text())
    return decode(Path(out).read_text())
