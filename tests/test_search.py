"""The largest batch that fits, as a pure function of ``fits(batch)``: no widgets, no model."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from memlab.panel.search import MAX_BATCH, largest_batch, predicted_batch


@pytest.mark.parametrize("edge", [1, 2, 3, 7, 8, 9, 100, 1000, 24_610, MAX_BATCH - 1])
def test_it_finds_the_edge_of_a_monotone_predicate(edge: int) -> None:
    tried: list[int] = []

    def fits(batch: int) -> bool:
        tried.append(batch)
        return batch <= edge

    assert largest_batch(fits) == edge
    assert len(tried) <= 2 * math.ceil(math.log2(edge + 1)) + 2  # doubling, then halving
    assert len(set(tried)) == len(tried)  # no batch tried twice


@pytest.mark.parametrize(("edge", "step"), [(10, 4), (64, 8), (63, 8), (7, 8)])
def test_with_accumulation_it_stays_on_multiples_of_the_step(edge: int, step: int) -> None:
    tried: list[int] = []

    def fits(batch: int) -> bool:
        tried.append(batch)
        return batch <= edge

    assert largest_batch(fits, step) == edge // step * step
    assert all(b % step == 0 for b in tried)


def test_nothing_fits_and_everything_fits() -> None:
    assert largest_batch(lambda b: False) == 0
    assert largest_batch(lambda b: True, limit=1000) == 1000
    assert largest_batch(lambda b: True, 8, limit=1000) == 1000
    assert largest_batch(lambda b: True) == MAX_BATCH


def test_a_bad_step_names_the_argument() -> None:
    with pytest.raises(ValueError, match="step must be a whole number ≥ 1, not 0"):
        largest_batch(lambda b: True, 0)


# -- predicted_batch: the line of peak against batch, confirmed near the edge ------------------


def predicted(peak: Any, budget: int, step: int = 1, **kw: Any) -> tuple[int, list[int]]:
    tried: list[int] = []

    def measure(batch: int) -> tuple[bool, int | None]:
        tried.append(batch)
        p = peak(batch)
        return p <= budget, p

    return predicted_batch(measure, budget, step, **kw), tried


def bisected(peak: Any, budget: int, step: int = 1) -> tuple[int, list[int]]:
    tried: list[int] = []
    best = largest_batch(lambda b: tried.append(b) or peak(b) <= budget, step)
    return best, tried


@pytest.mark.parametrize("seed", range(40))
def test_a_straight_line_takes_five_steps_at_most_with_the_same_answer(seed: int) -> None:
    rng = random.Random(seed)
    fixed, per = rng.randrange(10**8), rng.randrange(1, 10**6)
    budget, step = rng.randrange(10**8, 10**11), rng.choice([1, 2, 8])
    got, tried = predicted(lambda b: fixed + per * b, budget, step)
    assert got == bisected(lambda b: fixed + per * b, budget, step)[0]
    assert got == min(MAX_BATCH // step * step, max(0, (budget - fixed) // per // step * step))
    # five, and one more for each 64-fold stretch past the third try the line is followed over
    # (a try that overshoots runs: on a CPU it takes the host's memory)
    stretches = sum(got > 4 * step * 64**k for k in (1, 2))
    assert len(tried) <= 5 + stretches and len(set(tried)) == len(tried)
    assert all(b % step == 0 for b in tried)


@pytest.mark.parametrize("seed", range(40))
def test_a_curve_costs_no_more_steps_than_halving(seed: int) -> None:
    rng = random.Random(seed)
    fixed, per, power = rng.randrange(10**6), rng.randrange(1, 10**4), rng.choice([0.5, 1.5, 2])
    budget = rng.randrange(10**6, 10**10)

    def peak(b: int) -> int:
        return int(fixed + per * b**power + (b % 7) * 1000)  # bumpy, and still monotone enough

    monotone = [peak(b) <= budget for b in range(1, 4000)]
    if monotone != sorted(monotone, reverse=True):
        pytest.skip("this draw is not monotone: no search's answer is defined")
    got, tried = predicted(peak, budget)
    want, halving = bisected(peak, budget)
    assert got == want and len(tried) <= len(halving) + 2 and len(set(tried)) == len(tried)


def test_without_peaks_it_halves_and_doubles_like_the_plain_search() -> None:
    for edge in (1, 7, 100, 24_610):
        tried: list[int] = []

        def measure(b: int, edge: int = edge, tried: list[int] = tried) -> tuple[bool, int | None]:
            tried.append(b)
            return b <= edge, None  # an out-of-memory error each time: no peak to draw from

        assert predicted_batch(measure, 10**9) == edge
        assert len(tried) <= 2 * math.ceil(math.log2(edge + 1)) + 2


def test_stop_keeps_the_largest_found_so_far_and_a_bad_step_is_named() -> None:
    calls: list[int] = []
    got = predicted_batch(
        lambda b: (calls.append(b) or True, b), 10**6, stop=lambda: len(calls) >= 3
    )
    assert got == calls[-1] and len(calls) == 3
    with pytest.raises(ValueError, match="step must be a whole number ≥ 1, not 0"):
        predicted_batch(lambda b: (True, b), 10, 0)
    assert predicted(lambda b: 100 + b, 50)[0] == 0  # not even one fits
    assert predicted(lambda b: 0, 50)[0] == MAX_BATCH  # everything fits


def test_a_line_that_meets_the_budget_far_away_is_tested_by_a_cheap_try_first() -> None:
    # batch 1 and 2 draw a line that meets the budget near batch 1,000: before following it,
    # batch 4 (not 16, as a jump cut short would be) tests it; it foretells 4's peak, so the
    # search goes straight to the edge and confirms it
    fixed, per = 10**9, 10**6
    budget = fixed + per * 200 + per // 2
    got, tried = predicted(lambda b: fixed + per * b, budget)
    assert got == 200 and tried == [1, 2, 4, 200, 201]
    # followed at most 64 times past the batch that tested it: a kink past it (here at 8) is
    # met at 256, not at the line's own meeting with the budget (near 65,536)
    kinked = lambda b: fixed + 512 * b + per * 10 * max(0, b - 8)  # noqa: E731
    got, tried = predicted(kinked, fixed + 512 * 65536)
    assert tried[:4] == [1, 2, 4, 256] and max(tried) <= 256
    assert got == largest_batch(lambda b: kinked(b) <= fixed + 512 * 65536)
    # a line whose growth 4's peak does not follow (a fixed part does not make it lenient)
    got, tried = predicted(lambda b: fixed + per * b * b, fixed + per * 1000**2)
    assert got == 1000 and tried[:3] == [1, 2, 4] and tried[3] <= 8 * 4


def test_peaks_alike_in_the_allocators_rounding_do_not_leave_the_search_doubling() -> None:
    # peaks rounded up to 2 MiB blocks: batches 2 and 4 look alike (no line), and the
    # doublings without a line do not count as a line too slow: the line comes back once the
    # peaks rise apart (12 tries; without that, it doubled to 4,096 and took 17)
    def rounded(b: int) -> int:
        return -(-(10**9 + 300_000 * b) // 2**21) * 2**21

    budget = rounded(2594)
    got, tried = predicted(rounded, budget)
    want, halving = bisected(rounded, budget)
    assert got == want and len(tried) <= len(halving) // 2 and max(tried) < 2 * got
