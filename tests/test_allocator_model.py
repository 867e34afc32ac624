"""The caching-allocator model against the rules, case by case (hand-computed), and invariants
over random streams. Real traces recorded on a GPU are the next check (issue 7)."""

from __future__ import annotations

import random

import pytest

from memlab.estimate.allocator import (
    CachingAllocator,
    MiB,
    SimulatedOutOfMemoryError,
    round_size,
    segment_size,
)


@pytest.mark.parametrize(
    ("request_", "rounded"), [(1, 512), (512, 512), (513, 1024), (4_000_000, 4_000_256)]
)
def test_requests_round_up_to_512(request_: int, rounded: int) -> None:
    assert round_size(request_) == rounded


@pytest.mark.parametrize(
    ("rounded", "segment"),
    [
        (512, 2 * MiB),
        (MiB, 2 * MiB),
        (MiB + 512, 20 * MiB),
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),
        (11 * MiB + 512, 12 * MiB),
    ],
)
def test_segment_sizes(rounded: int, segment: int) -> None:
    assert segment_size(rounded) == segment


def test_small_requests_share_a_2_mib_segment() -> None:
    a = CachingAllocator()
    h1, h2 = a.malloc(1), a.malloc(1000)
    assert (a.block_size(h1), a.block_size(h2)) == (512, 1024)
    assert a.stats.allocated == 1536 and a.stats.reserved == 2 * MiB and a.stats.segments == 1


def test_large_requests_split_a_20_mib_segment() -> None:
    a = CachingAllocator()
    a.malloc(4 * MiB)
    a.malloc(4 * MiB)  # from the 16 MiB left of the same segment
    assert a.stats.reserved == 20 * MiB and a.stats.allocated == 8 * MiB


def test_a_remainder_of_at_most_1_mib_is_not_split_off() -> None:
    a = CachingAllocator()
    h = a.malloc(11 * MiB + 1)  # 11 MiB + 512 in a 12 MiB segment: 1 MiB - 512 left
    assert a.block_size(h) == 12 * MiB  # memory_allocated counts the whole block
    assert a.stats.allocated == 12 * MiB


def test_best_fit_takes_the_smallest_free_block_that_fits() -> None:
    a = CachingAllocator()
    h12, h16 = a.malloc(12 * MiB), a.malloc(16 * MiB)  # segments of exactly 12 and 16 MiB
    a.free(h16)
    a.free(h12)
    h = a.malloc(11 * MiB)  # fits both; the 12 MiB block is the smaller (1 MiB left: no split)
    assert a.block_size(h) == 12 * MiB
    h2 = a.malloc(15 * MiB)  # only the 16 MiB block fits
    assert a.block_size(h2) == 16 * MiB and a.stats.segments == 2


def test_equal_blocks_are_taken_lowest_address_first() -> None:
    a = CachingAllocator()
    first, second = a.malloc(12 * MiB, 0, 0x2000_0000), a.malloc(12 * MiB, 0, 0x1000_0000)
    a.free(first)
    a.free(second)
    assert a._live[a.malloc(12 * MiB)].segment == 0x1000_0000


def test_without_the_drivers_addresses_new_segments_lie_below_the_others() -> None:
    # the driver's order in the validation runs' traces (tests/test_estimate_warmup.py)
    a = CachingAllocator()
    first, second = a.malloc(12 * MiB), a.malloc(12 * MiB)
    lower = a._live[second].segment
    assert lower + 12 * MiB < a._live[first].segment  # below, and not contiguous
    a.free(second)
    a.free(first)
    assert a._live[a.malloc(12 * MiB)].segment == lower


def test_free_merges_neighbours_and_empty_cache_returns_whole_segments() -> None:
    a = CachingAllocator()
    x, y, z = a.malloc(4 * MiB), a.malloc(4 * MiB), a.malloc(4 * MiB)
    a.free(x)
    a.free(z)
    a.empty_cache()
    assert a.stats.reserved == 20 * MiB  # y still holds the segment
    a.free(y)
    assert a.stats.allocated == 0 and a.stats.reserved == 20 * MiB  # cached, not returned
    a.empty_cache()
    assert a.stats.reserved == 0 and a.stats.segments == 0


def test_blocks_are_reused_only_on_their_own_stream() -> None:
    a = CachingAllocator()
    a.free(a.malloc(4 * MiB, stream=1))
    a.malloc(4 * MiB, stream=2)
    assert a.stats.reserved == 40 * MiB and a.stats.segments == 2


def test_capacity_frees_the_cache_retries_then_runs_out() -> None:
    a = CachingAllocator(capacity=30 * MiB)
    a.free(a.malloc(8 * MiB))  # a cached 20 MiB segment
    a.malloc(24 * MiB)  # 20 + 24 > 30: the cache goes back, then it fits
    assert a.stats.alloc_retries == 1 and a.stats.reserved == 24 * MiB
    with pytest.raises(SimulatedOutOfMemoryError, match="cannot reserve"):
        a.malloc(24 * MiB)
    assert a.stats.ooms == 1 and a.stats.alloc_retries == 2
    assert a.stats.peak_reserved == 24 * MiB and a.stats.peak_allocated == 24 * MiB


@pytest.mark.parametrize("seed", range(5))
def test_invariants_over_a_random_stream(seed: int) -> None:
    rng = random.Random(seed)
    a = CachingAllocator()
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            h = rng.choice(list(live))
            a.free(h)
            del live[h]
        else:
            size = rng.choice(
                [rng.randint(1, 4096), rng.randint(1, 2 * MiB), rng.randint(1, 64 * MiB)]
            )
            h = a.malloc(size, stream=rng.randint(0, 1))
            live[h] = size
            assert a.block_size(h) >= round_size(size)
        if rng.random() < 0.01:
            a.empty_cache()
        assert a.stats.allocated == sum(a.block_size(h) for h in live)
        assert a.stats.reserved >= a.stats.allocated
    # every segment is tiled exactly by its blocks, free and used
    blocks = [b for pool in a._free.values() for _, _, b in pool] + list(a._live.values())
    by_segment: dict[int, list[int]] = {}
    for b in blocks:
        by_segment.setdefault(b.segment, []).append(b.size)
    assert sum(sum(s) for s in by_segment.values()) == a.stats.reserved
    assert len(by_segment) == a.stats.segments
