"""Embedding lookups on ``meta``, where the indices have no values.

A GPU fails a lookup past an embedding's rows (a device-side assert), the CPU too (``index out
of range in self``); on meta nothing is read, so the step runs and would be predicted to fit.
Token ids past the vocabulary cannot be seen there: each estimate that looked something up says
so in its notes. One case can be seen from shapes alone: a learned position table, looked up
with one position per token of the sequence. Its rows are the model's
``max_position_embeddings`` (``n_positions``), and a sequence longer than that reads past them
whatever the positions are; the estimate refuses it (`LookupChecks`), as the GPU would. Models
whose positions are computed (RoPE: Llama, Qwen2, ...) have no such table and are not affected.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from memlab.core import _torch
from memlab.step import WhatIfError
from memlab.step.tables import position_tables

#: The note of an estimate whose step looked up an embedding (`LookupChecks.assumed`).
UNCHECKED = "every embedding index within its table's rows: token ids, positions, types"


class LookupChecks:
    """Within the block, ``F.embedding`` on meta: the lookup checked against the learned position
    tables `learn` found, and ``assumed`` told (once) that the indices were not checked."""

    def __init__(self, assumed: list[str]) -> None:
        self.assumed = assumed
        self._tables: weakref.WeakKeyDictionary[nn.Embedding, tuple[str, str, int]] = (
            weakref.WeakKeyDictionary()
        )
        self._stack = contextlib.ExitStack()
        self._inner: Any = F.embedding  # (what the block wraps: set again at each entry)

    def learn(self, model: Any) -> None:
        """Notes the learned position tables of ``model`` (built for this estimate)."""
        if isinstance(model, nn.Module):
            self._tables.update(position_tables(model))

    def __enter__(self) -> LookupChecks:
        self._inner = F.embedding  # (a patch of the program's, or another of memlab's, kept)
        self._stack.enter_context(_torch.patched([(F, "embedding", self._embedding)]))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()  # F.embedding as it was

    def _embedding(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kw: Any) -> Any:
        if isinstance(input, torch.Tensor) and input.is_meta:
            if UNCHECKED not in self.assumed:
                self.assumed.append(UNCHECKED)
            if input.dim() > 0:
                self._check(input.shape[-1], weight)
        return self._inner(input, weight, *args, **kw)

    def _check(self, length: int, weight: torch.Tensor) -> None:
        for table, (path, field, n) in list(self._tables.items()):
            if table.weight is weight and length > n:
                raise WhatIfError(
                    f"the step's sequences are {length} tokens long, but the model's learned "
                    f"position table ({path}: {table.num_embeddings} rows, config.{field}={n}) "
                    f"holds positions for at most {n}: on a GPU (or the CPU) the lookup fails "
                    f"with an index out of range. Pass sequences of at most {n} tokens from "
                    f"input_fn, or a model whose config.{field} is at least {length}."
                )
