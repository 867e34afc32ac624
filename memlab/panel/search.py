"""The largest batch that fits, as a pure function of a ``fits(batch)`` predicate."""

from __future__ import annotations

from collections.abc import Callable

#: The largest batch the search tries.
MAX_BATCH = 1 << 16


def largest_batch(fits: Callable[[int], bool], step: int = 1, limit: int = MAX_BATCH) -> int:
    """The largest multiple of ``step`` up to ``limit`` for which ``fits`` is true, assuming
    that what fits at one batch fits at every smaller one: doubling from ``step`` until a batch
    does not fit, then halving the interval. 0 when not even ``step`` fits; ``fits`` is called
    about 2 log2(answer / step) times, never twice for one batch."""
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be a whole number ≥ 1, not {step!r}.")
    lo, hi = 0, step
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:  # past the limit counts as not fitting: search up to the limit itself
        hi = limit // step * step + step
    while hi - lo > step:  # lo fits (or is 0), hi does not
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
