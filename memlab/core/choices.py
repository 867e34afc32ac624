"""String enums for every user-facing choice: compare equal to their strings, and parse them."""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

C = TypeVar("C", bound="Choice")


class Choice(str, Enum):
    """A string choice. ``Amp.FP16 == "fp16"``; ``str()`` and f-strings give the value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls: type[C], name: str, value: Any, error: type[Exception] = ValueError) -> C:
        """``value`` as a member (a member or its string); otherwise ``error`` naming the
        argument ``name``, what it got and the choices."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise error(f"{name}={value!r} is not one of {allowed}.") from None

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class Source(Choice):
    """Where a report's numbers come from."""

    CUDA_ALLOCATOR = "cuda-allocator"  # the caching allocator's own counters
    TENSOR_ACCOUNTING = "tensor-accounting"  # bytes of the tensor storages memlab saw
    ESTIMATE = "estimate"  # a prediction by memlab.estimate, not a measurement
    # the CPU allocator's own record (memlab.core.allocations): sees inside compiled code
    CPU_ALLOCATOR = "cpu-allocator"


class PeakScope(Choice):
    """What a report's peak covers."""

    REGION = "region"  # the highest value inside the region
    SINCE_RESET = "since-reset"  # since the allocator's peak counter was last reset


class TimelineSource(Choice):
    """What a timeline's points count."""

    TENSOR_ACCOUNTING = "tensor accounting"
    ALLOCATOR_MODEL = "allocator model"
    SNAPSHOT = "cuda snapshot"  # a trace recorded by torch.cuda.memory._record_memory_history
    ALLOCATION_RECORD = "cpu allocator record"  # memlab.core.allocations: every allocation
