"""The largest batch that fits, as a pure function of a ``fits(batch)`` predicate."""

from __future__ import annotations

from collections.abc import Callable

#: The largest batch the search tries.
MAX_BATCH = 1 << 16


def largest_batch(
    fits: Callable[[int], bool],
    step: int = 1,
    limit: int = MAX_BATCH,
    *,
    on_try: Callable[[int, int, int | None], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> int:
    """The largest multiple of ``step`` up to ``limit`` for which ``fits`` is true, assuming
    that what fits at one batch fits at every smaller one: doubling from ``step`` until a batch
    does not fit, then halving the interval. 0 when not even ``step`` fits; ``fits`` is called
    about 2 log2(answer / step) times, never twice for one batch.

    on_try(batch, fits_so_far, too_big_so_far): called before each try (progress).
    stop(): asked before each try; when true, the search ends with the best batch found so far.
    """
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be a whole number ≥ 1, not {step!r}.")
    too_big: int | None = None

    def tried(batch: int) -> bool | None:
        if stop is not None and stop():
            return None
        if on_try is not None:
            on_try(batch, lo, too_big)
        return fits(batch)

    lo, hi = 0, step
    while hi <= limit:
        ok = tried(hi)
        if ok is None:
            return lo
        if not ok:
            break
        lo, hi = hi, hi * 2
    if hi > limit:  # past the limit counts as not fitting: search up to the limit itself
        hi = limit // step * step + step
    too_big = hi
    while hi - lo > step:  # lo fits (or is 0), hi does not
        mid = (lo + hi) // 2 // step * step
        ok = tried(mid)
        if ok is None:
            return lo
        lo, hi = (mid, hi) if ok else (lo, mid)
        too_big = hi
    return lo
