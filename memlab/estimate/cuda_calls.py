"""``torch.cuda``'s everyday calls during a pre-flight (``%%gpumem --gpu T4``), where the cell
runs on the CPU: a training loop written for a GPU calls ``torch.cuda.synchronize()`` or prints
``torch.cuda.memory_allocated()``, which raise without CUDA. For the cell they answer from the
simulated GPU instead: the figures of the allocator model the cell is replayed through, and
the calls that only wait or tidy (``synchronize``, ``empty_cache``) do nothing.

The peak counters answer the cell's peak so far: a reset inside the cell does not move the
pre-flight's own peak, which is the verdict's. Names imported before the cell (``from
torch.cuda import memory_allocated``) keep PyTorch's own functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memlab.estimate.allocator import Stats
from memlab.estimate.gpus import GPU

_NOTHING: tuple[str, ...] = ("synchronize", "empty_cache", "ipc_collect")
_NOTHING += ("reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached")
_NOTHING += ("reset_accumulated_memory_stats",)
_FIGURES = {
    "memory_allocated": "allocated",
    "max_memory_allocated": "peak_allocated",
    "memory_reserved": "reserved",
    "max_memory_reserved": "peak_reserved",
}


@contextlib.contextmanager
def simulated(stats: Callable[[], Stats], card: GPU) -> Iterator[None]:
    """For the block, ``torch.cuda``'s calls above answer from ``stats()`` (``mem_get_info``:
    what is left of ``card``'s usable memory, and its size); each is put back on exit, also on
    an exception."""
    cuda = torch.cuda

    def figure(field: str) -> Callable[..., int]:
        def read(device: Any = None) -> int:
            return int(getattr(stats(), field))

        return read

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        return max(card.usable - stats().reserved, 0), card.memory

    patches: dict[str, Any] = {name: nothing for name in _NOTHING}
    patches |= {name: figure(field) for name, field in _FIGURES.items()}
    patches["mem_get_info"] = mem_get_info
    before = {name: cuda.__dict__[name] for name in patches if name in cuda.__dict__}
    try:
        for name, new in patches.items():
            if name in before:
                setattr(cuda, name, new)
        yield
    finally:
        for name, old in before.items():
            setattr(cuda, name, old)
