"""Replaying allocator traces through the model: agreement and the first divergence.

The traces here are written by hand in the snapshot's format, each event following the caching
allocator's documented rules (2 MiB segments for small requests, 20 MiB for requests under
10 MiB, larger ones rounded up to 2 MiB; best-fit reuse of freed blocks; segments released only
by empty_cache). Traces recorded on a GPU are to join them in tests/data/ (none is recorded yet:
no GPU has been available to this project's test runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memlab.estimate.trace import events_of, load, replay, synthetic

MiB = 2**20


def rules_trace() -> list[dict]:
    return synthetic(
        [
            ("segment_alloc", 0x1000_0000, 2 * MiB),  # a small request gets a 2 MiB segment
            ("alloc", 0x1000_0000, 1000),
            ("alloc", 0x1000_0400, 3000),  # the same segment: no new one
            ("segment_alloc", 0x2000_0000, 20 * MiB),  # 5 MiB < 10 MiB: a 20 MiB segment
            ("alloc", 0x2000_0000, 5 * MiB),
            ("free_requested", 0x2000_0000, 5 * MiB),
            ("free_completed", 0x2000_0000, 5 * MiB),
            ("alloc", 0x2000_0000, 4 * MiB),  # reuses the cached 20 MiB segment
            ("segment_alloc", 0x4000_0000, 30 * MiB),  # 30 MiB: its own segment, 2 MiB multiple
            ("alloc", 0x4000_0000, 30 * MiB - 100),
            ("free_completed", 0x4000_0000, 30 * MiB - 100),
            ("segment_free", 0x4000_0000, 30 * MiB),  # empty_cache(): the wholly free segment
        ]
    )


def test_a_trace_that_follows_the_rules_replays_exactly() -> None:
    r = replay(rules_trace())
    assert r.exact and r.first_divergence is None
    assert (r.allocations, r.agreed) == (5, 5)
    assert r.real_reserved == r.model_reserved == 22 * MiB
    assert r.real_requested == 1000 + 3000 + 4 * MiB
    assert r.model_allocated == 512 * 2 + 3072 + 4 * MiB  # blocks: 1000 and 3000 B round up
    assert "agreed on 5" in str(r)


def test_the_first_divergence_is_named() -> None:
    trace = rules_trace()
    # pretend the real allocator took a new segment where the rules reuse the cached one
    trace.insert(7, {"action": "segment_alloc", "addr": 0x3000_0000, "size": 20 * MiB})
    r = replay(trace)
    assert not r.exact and r.agreed == 3
    d = r.first_divergence
    assert d is not None and d.index == 8 and d.event["size"] == 4 * MiB
    assert "reserved a 20,971,520 B segment" in d.real and d.model == "reused"
    assert "first divergence: event 8 (alloc of 4,194,304 B)" in str(r)


def test_snapshots_and_files_load(tmp_path: Path) -> None:
    snapshot = {"segments": [], "device_traces": [[], rules_trace()]}
    assert events_of(snapshot) == rules_trace()  # the device with events
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(snapshot))
    assert replay(load(path)).exact
    with pytest.raises(ValueError, match="_record_memory_history"):
        events_of({"segments": []})
