"""Allocations whose size a GPU library chooses at run time, and the range they give a figure.

A cuDNN workspace, for instance, has the size of the algorithm cuDNN picks on the card, which a
machine without the card cannot know. The emulation that makes such an allocation
(`memlab.estimate.kernels`) gives it a predicted size and a range (`uncertain_empty`); the
allocator model's listener (`memlab.estimate.listener`) replays the stream three times at once,
each such allocation at its predicted, smallest and largest size, and the peaks of the last two
bound the figures (`Estimate.bounds`). Each range's source is documented where it is made
(docs/estimator.md, "Ranges").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from memlab.reports.units import fmt_bytes

_state = threading.local()


@dataclass(frozen=True)
class Spread:
    """One allocation's size: predicted, and the range that contains the truth."""

    cause: str
    size: int
    low: int
    high: int


@dataclass(frozen=True)
class Cause:
    """What makes a figure uncertain: an op's allocations of a size chosen at run time."""

    #: The op and what it allocates: "aten._cudnn_rnn: cuDNN LSTM workspace".
    cause: str
    #: How many such allocations the estimate made (warm-up step included).
    calls: int
    #: The largest of them: predicted size, smallest and largest.
    size: int
    low: int
    high: int

    def describe(self) -> str:
        sizes = f"{fmt_bytes(self.low)}–{fmt_bytes(self.high)}"
        many = f" ({self.calls} calls, the largest)" if self.calls > 1 else ""
        return f"{self.cause}: {sizes}, predicted {fmt_bytes(self.size)}{many}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "calls": self.calls,
            "size": self.size,
            "low": self.low,
            "high": self.high,
        }


def uncertain_empty(
    nbytes: int, low: int, high: int, cause: str, like: torch.Tensor
) -> torch.Tensor:
    """A byte buffer of ``nbytes`` on ``like``'s device, whose real size lies in ``[low, high]``
    (chosen at run time by ``cause``); the allocator model's listener is told so."""
    low, high = min(low, nbytes), max(high, nbytes)
    pending: list[Spread] = _state.__dict__.setdefault("pending", [])
    pending.append(Spread(cause, nbytes, low, high))
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=like.device)
    finally:
        pending.clear()  # told, or nobody listening


def claim(nbytes: int) -> Spread | None:
    """The range of the allocation of ``nbytes`` being made now, if it was made uncertain."""
    pending: list[Spread] = _state.__dict__.get("pending", [])
    if pending and pending[-1].size == nbytes:
        return pending.pop()
    return None


def summarise(spreads: list[Spread]) -> tuple[Cause, ...]:
    """One `Cause` per cause, in the order they first appeared, with its largest allocation."""
    causes: dict[str, Cause] = {}
    for s in spreads:
        seen = causes.get(s.cause)
        calls = 1 if seen is None else seen.calls + 1
        if seen is None or s.high - s.low > seen.high - seen.low or s.size > seen.size:
            causes[s.cause] = Cause(s.cause, calls, s.size, s.low, s.high)
        else:
            causes[s.cause] = Cause(s.cause, calls, seen.size, seen.low, seen.high)
    return tuple(causes.values())
