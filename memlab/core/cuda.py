"""The CUDA caching allocator's own counters, read as seldom as possible.

``torch.cuda.memory_stats()`` builds the whole statistics dict and flattens it in Python (~120 µs
on an H100), so a region reads the allocator's nested statistics once at each end. Resetting the
peak counter at the start makes the end's peak the region's own. Regions nest: before an inner
region resets the counter, every open region on that device folds the peak seen so far into its
own floor, so no peak is lost.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class Counters:
    allocated: int
    reserved: int
    active: int
    peak_allocated: int
    peak_reserved: int
    alloc_retries: int
    ooms: int


@dataclass(frozen=True)
class DriverView:
    """What the driver says: free and total memory on the device, and this process's use (NVML)."""

    free: int
    total: int
    process_used: int | None


_ZERO = Counters(0, 0, 0, 0, 0, 0, 0)


def read_counters(index: int) -> Counters:
    """The allocator's counters in one call, read from its nested statistics (what
    ``memory_stats`` flattens and sorts in Python first). Zero before CUDA is initialised."""
    if not torch.cuda.is_initialized():
        return _ZERO
    s = torch.cuda.memory_stats_as_nested_dict(index)

    def every_pool(name: str, field: str) -> int:
        return int(s.get(name, {}).get("all", {}).get(field, 0))

    return Counters(
        allocated=every_pool("allocated_bytes", "current"),
        reserved=every_pool("reserved_bytes", "current"),
        active=every_pool("active_bytes", "current"),
        peak_allocated=every_pool("allocated_bytes", "peak"),
        peak_reserved=every_pool("reserved_bytes", "peak"),
        alloc_retries=int(s.get("num_alloc_retries", 0)),
        ooms=int(s.get("num_ooms", 0)),
    )


def allocated(device: torch.device | int) -> int:
    """``memory_allocated``: bytes in the blocks the allocator has handed out now."""
    return int(torch.cuda.memory_allocated(device))


def headroom(device: torch.device | int) -> int:
    """What a step on the device could use at most: allocated now plus the driver's free."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free) + allocated(device)


def cache_state(index: int) -> tuple[list[dict[str, Any]], int] | None:
    """The caching allocator's segments on the device (``torch.cuda.memory_snapshot()``'s, each
    with its blocks) and what it may reserve in all (reserved now plus the driver's free), or
    None before CUDA is initialised."""
    if not torch.cuda.is_initialized():
        return None
    segments = [s for s in torch.cuda.memory_snapshot() if s.get("device", index) == index]
    free, _ = torch.cuda.mem_get_info(index)
    return segments, int(free) + int(torch.cuda.memory_reserved(index))


def driver_view(index: int) -> DriverView:
    """``mem_get_info`` and, when nvidia-ml-py is installed, NVML's figure for this process."""
    free, total = torch.cuda.mem_get_info(index)
    return DriverView(free=free, total=total, process_used=_nvml_process_used(index))


def _nvml_process_used(index: int) -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(
            uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        )
        pid = os.getpid()
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return None
    except Exception:  # NVML missing, container PID namespaces, old drivers: no figure
        return None


class CudaRegion:
    """Counters for one device over one region."""

    _open: ClassVar[dict[int, list[CudaRegion]]] = {}
    _lock = threading.Lock()

    def __init__(self, index: int, reset_peak: bool) -> None:
        self.index = index
        self.reset_peak = reset_peak
        self.start: Counters = _ZERO
        self.end: Counters = _ZERO
        self.peak_floor = 0
        self.peak_reserved_floor = 0
        self.initialised_at_start = False

    def begin(self) -> None:
        self.initialised_at_start = torch.cuda.is_initialized()
        if self.initialised_at_start:
            torch.cuda.synchronize(self.index)
        self.start = read_counters(self.index)
        with CudaRegion._lock:
            stack = CudaRegion._open.setdefault(self.index, [])
            if self.reset_peak and self.initialised_at_start:
                for outer in stack:
                    outer._fold(self.start)
                torch.cuda.reset_peak_memory_stats(self.index)
            stack.append(self)

    def _fold(self, seen: Counters) -> None:
        self.peak_floor = max(self.peak_floor, seen.peak_allocated)
        self.peak_reserved_floor = max(self.peak_reserved_floor, seen.peak_reserved)

    def close(self) -> None:
        """Leave the stack of open regions (idempotent); later regions stop folding into it."""
        with CudaRegion._lock:
            stack = CudaRegion._open.get(self.index, [])
            if self in stack:
                stack.remove(self)

    def finish(self) -> None:
        self.close()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize(self.index)
        self.end = read_counters(self.index)

    @property
    def peak_is_regional(self) -> bool:
        """True when the peak covers exactly this region (reset at its start, or CUDA was not
        initialised before it, so every counter started at zero)."""
        return self.reset_peak or not self.initialised_at_start

    @property
    def peak_allocated(self) -> int:
        peak = max(self.end.peak_allocated, self.peak_floor)
        # A region's peak is never below what it started or ended with.
        return (
            max(peak, self.start.allocated, self.end.allocated) if self.peak_is_regional else peak
        )

    @property
    def peak_reserved(self) -> int:
        peak = max(self.end.peak_reserved, self.peak_reserved_floor)
        return max(peak, self.start.reserved, self.end.reserved) if self.peak_is_regional else peak
