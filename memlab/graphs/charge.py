"""Charging what each node saved to the graph's total: each storage once, to the earliest node
that saved it; what exists anyway (parameters, buffers, the forward's inputs) apart; and, where
an activation checkpoint's hook packed a saved tensor, the checkpoint's inputs in its place."""

from __future__ import annotations

from typing import Any

import torch

from memlab.graphs.args import sizes
from memlab.graphs.model import KINDS, Saved
from memlab.graphs.packed import Packed, frame_inputs, frame_keywords
from memlab.graphs.saved import saved_values, storages, wrapped_number

#: The row a checkpoint's inputs get, on the first node each checkpoint made.
CHECKPOINT_INPUT = "checkpoint input"


class Ledger:
    """What the nodes charged so far. ``fixed``: storages of parameters and buffers; ``given``:
    storages of the forward's inputs. `keep` holds every storage read, so that no id is reused
    while the graph is built."""

    def __init__(self, fixed: dict[int, Any], given: dict[int, Any]) -> None:
        self.fixed, self.given = fixed, given
        self.charged: set[int] = set()
        self.fixed_saved: dict[int, int] = {}
        self.keep: list[Any] = []
        self.frames: dict[int, Any] = {}  # each checkpoint once (kept alive: ids stay unique)
        self.unread = 0  # saved tensors without storage
        self.hooked = 0  # saved tensors another hook packed as something memlab cannot read
        self.keywords: dict[int, int] = {}  # storages checkpoints keep by keyword: their bytes

    def keyword_bytes(self) -> int:
        """Bytes the checkpoints keep alive by keyword and no node saved (not counted)."""
        return sum(b for k, b in self.keywords.items() if k not in self.charged)

    def node(self, node: Any) -> tuple[int, list[Saved]]:
        """The activation bytes charged to ``node`` and a row for each tensor it saved."""
        saved: list[Saved] = []
        total = 0
        for attr, value in saved_values(node):
            if isinstance(value, Packed):
                total += self._packed(attr, value, saved)
            else:
                total += self._tensor(attr, value, saved)
        return total, saved

    def _packed(self, attr: str, value: Packed, saved: list[Saved]) -> int:
        """A saved tensor a hook packed: a checkpoint's is recomputed in backward from the
        checkpoint's inputs, which are charged here the first time a node of it is met (and
        those of the checkpoints around it, where one packed them in turn); another hook's
        packed value is not counted (``unread``)."""
        if value.frame is None:
            self.hooked += 1
            saved.append(Saved(attr, (), "", 0, "unread"))
            return 0
        saved.append(Saved(attr, (), "", 0, "recomputed"))
        total, stack = 0, [value.frame]
        while stack:
            frame = stack.pop()
            if id(frame) in self.frames:
                continue
            self.frames[id(frame)] = frame
            for t in frame_inputs(frame):
                if not isinstance(t, Packed):
                    total += self._tensor(CHECKPOINT_INPUT, t, saved)
                elif t.frame is not None:
                    stack.append(t.frame)
                else:
                    self.hooked += 1
                    saved.append(Saved(CHECKPOINT_INPUT, (), "", 0, "unread"))
            self._keywords(frame)
        return total

    def _keywords(self, frame: Any) -> None:
        for t in frame_keywords(frame):
            for st in storages(t) or ():
                if id(st) not in self.fixed and id(st) not in self.given:
                    self.keep.append(st)
                    self.keywords[id(st)] = st.nbytes()

    def _tensor(self, attr: str, t: torch.Tensor, saved: list[Saved]) -> int:
        if wrapped_number(t):  # host memory outside any op: memlab.track leaves it out too
            saved.append(Saved(attr, (), _dtype(t), t.untyped_storage().nbytes(), "number"))
            return 0
        parts = storages(t)
        if parts is None:
            self.unread += 1
            saved.append(Saved(attr, sizes(t), _dtype(t), 0, "unread"))
            return 0
        self.keep.extend(parts)
        total, kinds_seen = 0, []
        for st in parts:
            key = id(st)
            if key in self.fixed:
                kinds_seen.append("parameter")
                self.fixed_saved[key] = st.nbytes()
            elif key in self.given:
                kinds_seen.append("input")
            elif key in self.charged:
                kinds_seen.append("shared")
            else:
                self.charged.add(key)
                kinds_seen.append("activation")
                total += st.nbytes()
        kind = next((k for k in KINDS if k in kinds_seen), "shared")
        saved.append(Saved(attr, sizes(t), _dtype(t), sum(st.nbytes() for st in parts), kind))
        return total


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
