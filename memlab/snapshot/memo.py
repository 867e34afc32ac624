"""Forgetting what a pickle loader's memo holds: `replace_memo` gives CPython's C loader a memo
with only the entries memlab keeps, so the events it has read can be freed.

The memo is the loader's table of every container and string it has made, by index, for a later
part of the pickle to refer to again (``BINGET``). Python lets it be read only whole
(``loader.memo.copy()``) and set only whole, and setting it from a dict drops what it is given
(the C loader stores the entries in its old table, then frees it). Setting it from another
loader's memo copies that loader's table slot by slot; so `_Mirror`, a loader of its own, reads
a pickle that memlab writes (never the user's file): one ``BINPERSID`` (an object from memlab's
own list) then ``LONG_BINPUT`` (into the slot it had) per entry kept. The file's loader goes on
numbering new entries from its own count, so later references land where they did.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np

#: One entry of the mirror's pickle: BININT k, BINPERSID, LONG_BINPUT index, POP.
_ENTRY = np.dtype(
    [("J", "u1"), ("k", "<i4"), ("Q", "u1"), ("r", "u1"), ("i", "<u4"), ("pop", "u1")]
)


class _Mirror(pickle.Unpickler):
    """A loader that puts memlab's own objects at given memo indices."""

    def __init__(self, data: bytes, objects: list[Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.objects = objects

    def persistent_load(self, pid: Any) -> Any:
        return self.objects[pid]


def replace_memo(loader: pickle.Unpickler, keep: Mapping[int, Any]) -> None:
    """Make ``loader``'s memo hold exactly ``keep`` (index -> object); what else it held is
    forgotten (and freed where nothing else refers to it)."""
    entries = np.zeros(len(keep), dtype=_ENTRY)
    entries["J"], entries["Q"], entries["r"], entries["pop"] = ord("J"), ord("Q"), ord("r"), 0x30
    entries["k"] = np.arange(len(keep), dtype=np.int32)
    entries["i"] = np.fromiter(keep.keys(), dtype=np.uint32, count=len(keep))
    mirror = _Mirror(b"\x80\x02" + entries.tobytes() + b"N.", list(keep.values()))
    mirror.load()
    # the dict setter frees the old table (and keeps the count): two tables at once, not three
    loader.memo = {}
    # the C loader copies another loader's memo proxy slot by slot
    loader.memo = mirror.memo
