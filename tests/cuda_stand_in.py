"""The seam's CUDA calls answered by a stand-in allocator, for the CUDA log's plumbing on a CPU
(`memlab.core.cuda_log`): the allocator's ``on``, ``start``, ``record`` and ``snapshot`` answer
what the GPU's would."""

from __future__ import annotations

from typing import Any


def stand_in(monkeypatch: Any, allocator: Any) -> None:
    """Points the log's CUDA calls at ``allocator`` for the test (CUDA said initialised, on
    the native allocator)."""
    from memlab.core import _torch, cuda_claim, cuda_log

    monkeypatch.setattr(cuda_claim.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda_claim.torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(cuda_claim, "cuda_history_on", lambda: allocator.on)
    monkeypatch.setattr(cuda_log, "cuda_history_on", lambda: allocator.on)
    monkeypatch.setattr(cuda_log, "start_cuda_log", allocator.start)
    monkeypatch.setattr(_torch, "record_memory_history", allocator.record)
    monkeypatch.setattr(_torch, "memory_snapshot", allocator.snapshot)


def replayed(tally: Any) -> Any:
    """A CUDA log's tally with its categories: its replay, left for the first read
    (`memlab.core.cuda_later`), made now; where it could not be made, the tally without."""
    if tally.later is None:
        return tally
    made, _ = tally.later()
    return tally if made is None else made
