"""The CUDA code path, run without a GPU against a simulated allocator's counters.

These tests check memlab's logic (which counter feeds which figure, peak folding across nested
regions, --no-reset, deltas of retries and OOMs, device validation, not initialising CUDA). The
real figures are checked against a real allocator by tests/test_cuda.py on a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import memlab
from memlab.core.cuda import CudaRegion

MiB = 1024**2


class FakeAllocator:
    """Counters like the caching allocator's, driven by the test."""

    def __init__(self, devices: int = 2) -> None:
        self.initialised = True
        self.devices = devices
        self.stats = [self._zero() for _ in range(devices)]
        self.reads = 0
        self.resets = 0

    @staticmethod
    def _zero() -> dict[str, int]:
        keys = ("allocated_bytes.all", "reserved_bytes.all", "active_bytes.all")
        s = {f"{k}.{p}": 0 for k in keys for p in ("current", "peak")}
        return {**s, "num_alloc_retries": 0, "num_ooms": 0}

    def alloc(self, n: int, device: int = 0) -> None:
        s = self.stats[device]
        for k in ("allocated_bytes.all", "active_bytes.all"):
            s[f"{k}.current"] += n
            s[f"{k}.peak"] = max(s[f"{k}.peak"], s[f"{k}.current"])
        if s["allocated_bytes.all.current"] > s["reserved_bytes.all.current"]:
            s["reserved_bytes.all.current"] = s["allocated_bytes.all.current"]
            s["reserved_bytes.all.peak"] = max(
                s["reserved_bytes.all.peak"], s["reserved_bytes.all.current"]
            )

    def free(self, n: int, device: int = 0) -> None:
        s = self.stats[device]
        s["allocated_bytes.all.current"] -= n
        s["active_bytes.all.current"] -= n

    def memory_stats(self, device: int) -> dict[str, int]:
        self.reads += 1
        return dict(self.stats[device])

    def nested(self, device: int) -> dict[str, Any]:
        """The same counters as the allocator's nested statistics (``memory_stats`` flattens
        these into "allocated_bytes.all.current" and the like)."""
        self.reads += 1
        out: dict[str, Any] = {}
        for key, value in self.stats[device].items():
            *path, last = key.split(".")
            level = out
            for part in path:
                level = level.setdefault(part, {})
            level[last] = value
        return out

    def reset_peak(self, device: int) -> None:
        self.resets += 1
        s = self.stats[device]
        for k in ("allocated_bytes.all", "reserved_bytes.all", "active_bytes.all"):
            s[f"{k}.peak"] = s[f"{k}.current"]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    a = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: a.devices)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: a.initialised)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", a.memory_stats)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", a.nested)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", a.reset_peak)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * MiB, 80 * MiB))
    CudaRegion._open.clear()
    return a


def test_figures_come_from_the_counters_read_once_at_each_end(fake: FakeAllocator) -> None:
    fake.alloc(100 * MiB)
    with memlab.track() as t:
        fake.alloc(40 * MiB)
        fake.alloc(200 * MiB)
        fake.free(200 * MiB)
    r = t.report
    assert r.device == "cuda:0" and r.source == "cuda-allocator"
    assert (r.allocated_before, r.allocated_after) == (100 * MiB, 140 * MiB)
    assert r.peak_allocated == 340 * MiB and r.peak_delta == 240 * MiB
    assert (r.reserved_before, r.reserved_after, r.peak_reserved) == (
        100 * MiB,
        340 * MiB,
        340 * MiB,
    )
    assert r.peak_scope == "region"
    assert fake.reads == 2 and fake.resets == 1
    assert r.breakdown is None and r.timeline is None  # no accounting installed on CUDA


def test_no_reset_reports_the_peak_since_the_last_reset(fake: FakeAllocator) -> None:
    fake.alloc(500 * MiB)
    fake.free(500 * MiB)
    with memlab.track(reset_peak=False) as t:
        fake.alloc(10 * MiB)
    assert fake.resets == 0
    assert t.report.peak_scope == "since-reset" and t.report.peak_allocated == 500 * MiB
    assert "since the allocator's peak counter was last reset" in str(t.report)


def test_nested_regions_fold_the_outer_peak_before_the_inner_reset(fake: FakeAllocator) -> None:
    with memlab.track() as outer:
        fake.alloc(300 * MiB)
        fake.free(300 * MiB)
        with memlab.track() as inner:
            fake.alloc(10 * MiB)
        fake.alloc(5 * MiB)
    assert inner.report.peak_delta == 10 * MiB
    assert outer.report.peak_delta == 300 * MiB  # lost to the inner reset without folding
    assert not CudaRegion._open[0]


def test_retries_and_ooms_are_deltas(fake: FakeAllocator) -> None:
    fake.stats[0]["num_ooms"] = 3
    fake.stats[0]["num_alloc_retries"] = 7
    with memlab.track() as t:
        fake.stats[0]["num_ooms"] += 1
        fake.stats[0]["num_alloc_retries"] += 2
    assert (t.report.ooms, t.report.alloc_retries) == (1, 2)
    text = str(t.report)
    assert "2 allocation retries" in text and "1 out-of-memory error(s)" in text


def test_all_devices_and_device_checks(fake: FakeAllocator) -> None:
    fake.alloc(8 * MiB, device=1)
    with memlab.track("all") as t:
        fake.alloc(4 * MiB, device=1)
    assert [r.device for r in t.reports] == ["cuda:0", "cuda:1"]
    assert t.reports[1].allocated_delta == 4 * MiB and t.reports[0].allocated_delta == 0
    with pytest.raises(memlab.DeviceError, match=r"has 2 CUDA device\(s\) \(cuda:0, cuda:1\)"):
        memlab.track("cuda:2")


def test_before_cuda_is_initialised_nothing_initialises_it(
    fake: FakeAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.initialised = False

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("memlab initialised CUDA")

    monkeypatch.setattr(torch.cuda, "current_device", refuse)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", refuse)
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    with memlab.track() as t:
        pass
    r = t.report
    assert r.device == "cuda:0" and r.allocated_before == r.allocated_after == 0
    assert r.peak_scope == "region"


def test_driver_view_and_failures_inside_the_region(fake: FakeAllocator) -> None:
    fake.alloc(20 * MiB)
    region = memlab.track(driver=True)
    with pytest.raises(KeyError), region:
        fake.alloc(1 * MiB)
        raise KeyError("x")
    r = region.report
    assert r.raised == "KeyError" and r.allocated_delta == 1 * MiB
    assert r.driver is not None and r.driver.total == 80 * MiB and r.driver.free == 60 * MiB
    assert "20.0 MiB of 80.0 MiB in use" in str(r)
    assert not CudaRegion._open[0]


def test_magic_on_the_cuda_path_reads_the_allocator_not_the_namespace(
    fake: FakeAllocator, ip: Any
) -> None:
    from conftest import run

    ip.user_ns["alloc"] = fake.alloc
    r = run(ip, "%%gpumem -o rep\nalloc(3 * 2**20)\n'done'")
    assert r.success
    rep = ip.user_ns["rep"]
    assert rep.source == "cuda-allocator" and rep.allocated_delta == 3 * MiB
    assert "CUDA caching allocator" in ip.rec.reports()[0]
    assert fake.reads == 2  # one stats read at each end of the cell, nothing more
    bad = run(ip, "%%gpumem -d cuda:5\nx = 1")
    assert "does not exist" in str(bad.error_in_exec) and "x" not in ip.user_ns
