"""Storages whose memory is not the CPU allocator's (shared memory, as a DataLoader worker's
batches arrive in the main process, and as ``share_memory_`` leaves a tensor): the native
record must give the dispatch mode's figures, and both the bytes the workload really holds.

``share_memory_`` copies a storage into shared memory and hands that memory to the same storage
in place; only the old block goes back to the allocator. The storage's bytes do not leave: the
free of its old block is not the storage's (it is looked for when the storage dies).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

import memlab
from memlab.core import native

pytestmark = pytest.mark.skipif(native.too_old() is not None, reason=str(native.too_old()))

N = 1 << 18  # floats
MB = 4 * N  # one tensor's bytes


def _measure(
    build: Callable[[], tuple[Callable[[], Any], int]],
    native_on: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[int, int, int]:
    monkeypatch.setenv("MEMLAB_NATIVE", "1" if native_on else "0")
    gc.collect()
    body, _ = build()  # (its own regions measured the same way)
    with memlab.track("cpu", timeline=True) as t:
        body()
    assert (t._native is not None) == native_on
    r = t.report
    # (the timeline's highest point: the same peak with a breakdown's replay)
    return (
        r.peak_allocated - r.allocated_before,
        r.allocated_after - r.allocated_before,
        max(r.timeline.allocated) - r.allocated_before,
    )


def shared_in_the_region() -> tuple[Callable[[], Any], int]:
    def body() -> None:
        xs = [torch.ones(N) for _ in range(3)]
        for x in xs:
            x.share_memory_()
        big = torch.ones(2 * N)  # three shared tensors and this one alive: 5 MB
        del xs, x, big

    return body, 5 * MB


def older_shared_in_the_region() -> tuple[Callable[[], Any], int]:
    with memlab.track():
        pass  # the allocator wrapper is in: x's block is one it follows
    held = [torch.ones(N)]
    with memlab.track():
        held[0] * 1  # the ledger follows x

    def body() -> None:
        held[0].share_memory_()
        big = torch.ones(2 * N)  # x (shared now) and this alive: 2 MB above the start
        del big
        held.clear()

    return body, 2 * MB


def rebuilt_from_shared_memory() -> tuple[Callable[[], Any], int]:
    # as torch.multiprocessing rebuilds a worker's batch: a new storage on a shared-memory fd
    sources = [torch.ones(N).share_memory_() for _ in range(3)]
    fds = [s.untyped_storage()._share_fd_cpu_()[0] for s in sources]

    def body(sources: list[torch.Tensor] = sources) -> None:  # (keeps their fds open)
        got = []
        for fd in fds:
            st = torch.UntypedStorage._new_shared_fd_cpu(os.dup(fd), MB)
            got.append(torch.empty(0).set_(st).view(torch.float32))
        del st
        z = got[1] * 2  # 4 MB
        del got[1]
        w = got[0] + z  # 4 MB again: the free of got[1] must be placed before it
        del got, z, w

    return body, 4 * MB


WORKLOADS = {
    "shared-in-region": shared_in_the_region,
    "older-shared-in-region": older_shared_in_the_region,
    "rebuilt-from-shm": rebuilt_from_shared_memory,
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_shared_memory_storages_native_equals_dispatch_and_truth(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    truth_peak = WORKLOADS[name]()[1]
    slow = _measure(WORKLOADS[name], False, monkeypatch)
    fast = _measure(WORKLOADS[name], True, monkeypatch)
    assert slow[0] == slow[2] == truth_peak, (slow, truth_peak)
    assert fast == slow, f"{name}: native {fast} vs dispatch mode {slow}"
