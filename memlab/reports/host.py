"""`HostMemory`: what a region kept in host memory by offloading, shown beside device memory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memlab.reports.units import fmt_bytes

#: What each kind of host copy is, as the reports name it.
KIND_NAMES = {
    "activations": "activations",
    "optimizer_state": "optimizer state",
    "master_weights": "fp32 master weights",
    "gradients": "gradients",
}


@dataclass(frozen=True)
class HostMemory:
    """Bytes an offload lever moved to host memory (CPU RAM), before, after and at their peak
    in the region, by kind; ``pinned_peak`` of them page-locked (pinned) at the most.
    ``allocator``: the CUDA caching host allocator's own counters (pinned memory) where torch
    has them, else None."""

    before: int
    after: int
    peak: int
    pinned_peak: int = 0
    at_end: Mapping[str, int] = field(default_factory=dict)
    highest: Mapping[str, int] = field(default_factory=dict)
    allocator: Mapping[str, int] | None = None

    def lines(self) -> list[str]:
        """The notes a report shows under its figures."""
        kinds = ", ".join(
            f"{KIND_NAMES.get(k, k)} {fmt_bytes(v)}" for k, v in self.highest.items() if v
        )
        line = "host: bytes offloaded to host memory (CPU RAM), not on the device"
        if kinds:
            line += f"; at their highest: {kinds}"
        if self.pinned_peak:
            line += f"; {fmt_bytes(self.pinned_peak)} of them pinned"
        out = [line]
        if self.allocator:
            active = self.allocator.get("active_bytes.current")
            held = self.allocator.get("allocated_bytes.current")
            if active is not None and held is not None:
                out.append(
                    f"host allocator (pinned memory, whole process): {fmt_bytes(active)} in "
                    f"use, {fmt_bytes(held)} held (in use and cached, sizes rounded up to "
                    "powers of two)"
                )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "before": self.before,
            "after": self.after,
            "peak": self.peak,
            "pinned_peak": self.pinned_peak,
            "at_end": dict(self.at_end),
            "highest": dict(self.highest),
            "allocator": None if self.allocator is None else dict(self.allocator),
        }
