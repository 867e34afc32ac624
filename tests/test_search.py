"""The largest batch that fits, as a pure function of ``fits(batch)``: no widgets, no model."""

from __future__ import annotations

import math

import pytest

from memlab.panel.search import MAX_BATCH, largest_batch


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
