"""The largest batch (or any whole number: a context length) that fits, as a pure function of
a ``fits(n)`` predicate, or of ``measure(n) -> (fits, peak)`` and a line drawn through peaks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

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


#: Without a known batch that is too big, a predicted try goes at most this many times past the
#: largest batch known to fit (a line drawn from small batches may be too flat), and its square
#: where the line foretold the peak of the try before it (a try that overshoots runs, and on a
#: CPU takes the host's memory and time).
MAX_JUMP = 8


def predicted_batch(
    measure: Callable[[int], tuple[bool, int | None]],
    budget: int,
    step: int = 1,
    limit: int = MAX_BATCH,
    *,
    on_try: Callable[[int, int, int | None], None] | None = None,
    stop: Callable[[], bool] | None = None,
    first: tuple[int, int] | None = None,
) -> int:
    """The same answer as ``largest_batch``, from fewer and mostly cheap runs: two small batches
    draw the line of peak against batch, the batch where it meets ``budget`` is tried, then the
    next one past it; each try redraws the line through the two tried batches nearest the edge.
    Where that first line meets the budget far away (past ``MAX_JUMP`` times the larger small
    batch), a third cheap try, at twice it, tests the line first: followed (up to ``MAX_JUMP``
    squared times that batch) where it foretold that try's peak, and cut short otherwise.
    Where a try gives no peak, or the line would not shorten the interval, it halves the
    interval (or doubles) as ``largest_batch`` does, so a peak that is far from a line costs no
    more tries than that search.

    measure(batch) -> (fits, peak): the peak in the units of ``budget`` (None when unknown,
    e.g. after an out-of-memory error). on_try and stop as for ``largest_batch``.
    first: the two tries that draw the first line (default: ``step`` and ``2 * step``; a
    context length starts higher, where the growth of a cache shows above the allocator's
    rounding).
    """
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be a whole number ≥ 1, not {step!r}.")
    top = limit // step * step
    peaks: dict[int, int] = {}
    bounds: list[Any] = [0, None]  # [0] fits (or is 0); [1], when known, does not
    firsts = first or (step, 2 * step)
    for batch in _tries(lambda: (bounds[0], bounds[1]), peaks, budget, step, top, firsts):
        if stop is not None and stop():
            break
        if on_try is not None:
            on_try(batch, bounds[0], bounds[1])
        ok, peak = measure(batch)
        if peak is not None:
            peaks[batch] = peak
        bounds[0 if ok else 1] = batch
    return int(bounds[0])


def _tries(
    bounds: Callable[[], tuple[int, int | None]],
    peaks: dict[int, int],
    budget: int,
    step: int,
    top: int,
    firsts: tuple[int, int],
) -> Iterator[int]:
    """The batches to try, each chosen once the previous one is measured."""
    for first in firsts:  # two cheap runs draw the first line
        lo, hi = bounds()
        if hi is not None or first > top:
            return
        yield first
    side, streak = None, 0  # which bound the last tries moved, and how many times in a row
    trusted = False  # whether the line foretold the last try's peak (its growth, closely)
    checked = False  # whether a cheap try has tested the first line before a long jump
    while True:
        lo, hi = bounds()
        low, high = lo + step, (hi - step if hi is not None else top)
        if low > high:
            return
        line = _line(peaks, lo, hi)
        guess = None if line is None else _meets(line, budget, step)
        capped = False  # a jump cut short is expected to fit: it does not count as a miss
        if hi is None:  # doubling, as largest_batch, when the line is missing or too slow
            if guess is None or streak >= 2:
                # (without a line, e.g. peaks alike in the allocator's rounding, a doubling is
                # no sign of a line too slow: it does not count towards the streak)
                capped = guess is None
                guess = max(low, 2 * lo)
            elif guess > MAX_JUMP * lo and not trusted:
                # the first line, untested, meets the budget far away: a cheap try at twice
                # the batch tests it first; later, a jump cut short
                guess = 2 * lo if not checked else MAX_JUMP * lo
                checked = capped = True
            elif guess > MAX_JUMP**2 * lo:  # a line that foretold a try, followed so far at most
                guess, capped = MAX_JUMP**2 * lo, True
        elif guess is None or streak >= 2:  # halving, as largest_batch
            guess = (lo + hi) // 2 // step * step
        batch = min(high, max(low, guess))
        yield batch
        moved = "lo" if bounds()[0] != lo else "hi"
        streak = 0 if capped else streak + 1 if moved == side else 1
        side = moved
        # foretold: within a twentieth of the growth the line gave this try past the last one
        # that fitted (not of the whole peak, which a large fixed part would make lenient)
        trusted = False
        if line is not None and batch in peaks:
            foretold = line[0] + line[1] * batch
            trusted = abs(peaks[batch] - foretold) <= line[1] * abs(batch - lo) / 20


def _line(peaks: dict[int, int], lo: int, hi: int | None) -> tuple[float, float] | None:
    """(intercept, slope) of peak against batch through the two measured batches nearest the
    edge, or None when there is no rising line."""
    below = sorted(b for b in peaks if b <= lo)
    above = sorted(b for b in peaks if hi is not None and b >= hi)
    pair = (below[-1:] + above[:1]) if above and below else (below + above)[-2:]
    if len(pair) < 2:
        return None
    (b1, p1), (b2, p2) = sorted((b, peaks[b]) for b in pair)
    if p2 <= p1:
        return None
    slope = (p2 - p1) / (b2 - b1)
    return p1 - slope * b1, slope


def _meets(line: tuple[float, float], budget: int, step: int) -> int:
    """The largest multiple of ``step`` whose peak on the line is within ``budget``."""
    intercept, slope = line
    return int((budget - intercept) / slope // step * step)
