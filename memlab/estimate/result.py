"""`Estimate`: a predicted step on a GPU, and how it renders."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memlab.core.warn import moved
from memlab.estimate.gpus import GPU
from memlab.estimate.spread import Cause
from memlab.reports.frame import heading, note
from memlab.reports.host import HostMemory
from memlab.reports.protocol import Result
from memlab.reports.report import MemoryReport
from memlab.reports.units import fmt_bytes
from memlab.step.config import RunConfig


@dataclass(frozen=True)
class Estimate(Result):
    """A predicted step on a GPU. Byte figures are what ``torch.cuda`` would report."""

    css = "memlab-estimate"

    config: RunConfig
    gpu: GPU | None
    #: The measured step's tensor accounting on ``meta``: breakdown, timeline, tensor bytes.
    tensors: MemoryReport
    #: The prediction, as a report: allocated (blocks) and reserved (segments), before, after
    #: and at the peak of the measured step, with the breakdown and timeline of ``tensors``.
    report: MemoryReport
    #: The simulated allocator ran out of the GPU's usable memory (``gpu.usable``).
    oom: bool = False
    #: Parameter bytes of each repeated block of the model: the units sharded data parallelism
    #: (FSDP) would gather one at a time (see `memlab.estimate.distributed`).
    fsdp_units: tuple[int, ...] = ()
    #: Each workspace the step took, in order: ("forward", bytes), ("forward lt", bytes), ...
    workspaces: tuple[tuple[str, int], ...] = ()
    #: With ``estimate(..., trace=True)``: the predicted allocation stream of the whole run
    #: (warm-up step included), as a snapshot: ``{"device_traces": [events], "measured":
    #: [first, end]}``, the measured step's events being ``events[first:end]``. Compare it with a
    #: real one with `memlab.estimate.trace.compare`.
    trace: dict[str, Any] | None = None
    #: The peaks (allocated, reserved) with every allocation of a size chosen at run time (see
    #: `causes`) at its smallest, and at its largest; None where there was none.
    low: tuple[int, int] | None = None
    high: tuple[int, int] | None = None
    #: What makes the figures uncertain: each op that allocated a size chosen at run time.
    causes: tuple[Cause, ...] = ()

    @property
    def host(self) -> HostMemory | None:
        """With ``offload``: what the step keeps in host memory (CPU RAM) instead of on the GPU
        (the report's "host" row); None without offload."""
        return self.report.host

    @property
    def host_peak(self) -> int:
        """Bytes the step holds in host memory at the most (0 without offload)."""
        return 0 if self.host is None else self.host.peak

    @property
    def bounds(self) -> dict[str, tuple[int, int]]:
        """``{"peak_allocated": (low, high), "peak_reserved": (low, high)}`` in bytes: the range
        that contains each figure whatever size the ops in `causes` choose on the card; equal
        bounds where the prediction is exact."""
        figures = {"peak_allocated": self.peak_allocated, "peak_reserved": self.peak_reserved}
        out = {}
        for i, (name, value) in enumerate(figures.items()):
            # reserved memory need not grow with the sizes: the extremes of the three runs
            runs = (
                [value]
                if self.low is None or self.high is None
                else [
                    value,
                    self.low[i],
                    self.high[i],
                ]
            )
            out[name] = (min(runs), max(runs))
        return out

    def range_lines(self) -> list[str]:
        """The range of each uncertain figure and its causes, as the displays show them."""
        lines = []
        for name, (low, high) in self.bounds.items():
            if low != high:
                value = self.peak_allocated if name == "peak_allocated" else self.peak_reserved
                below, above = (fmt_bytes(b - value, signed=True) for b in (low, high))
                lines.append(
                    f"range of {name.replace('_', ' ')}: {fmt_bytes(low)} to {fmt_bytes(high)} "
                    f"({below}, {above})"
                )
        if lines:
            lines += [f"uncertain: {c.describe()}" for c in self.causes]
        return lines

    @property
    def units(self) -> tuple[int, ...]:
        """Kept for one release: renamed `fsdp_units`."""
        moved("Estimate.units", "Estimate.fsdp_units")
        return self.fsdp_units

    @property
    def notes(self) -> tuple[str, ...]:
        """What the prediction includes and leaves out (the report's notes)."""
        return self.report.notes

    @property
    def peak_allocated(self) -> int:
        return self.report.peak_allocated

    @property
    def peak_reserved(self) -> int:
        assert self.report.peak_reserved is not None
        return self.report.peak_reserved

    @property
    def workspace(self) -> int:
        """Bytes of cuBLAS and cuBLASLt workspace the step took (see `workspaces`)."""
        return sum(size for _, size in self.workspaces)

    def fits(self, budget: int | None = None) -> bool:
        """Whether the step's peak *reserved* memory fits in ``budget`` bytes (default: the GPU's
        memory less the CUDA context allowance). Reserved, not allocated: the cache and
        fragmentation are memory the process holds too."""
        if budget is None:
            if self.gpu is None:
                raise ValueError("no GPU was given to estimate(): pass a budget in bytes.")
            budget = self.gpu.usable
        return not self.oom and self.peak_reserved <= budget

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.describe(),
            "gpu": None if self.gpu is None else self.gpu.name,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "workspace": self.workspace,
            "oom": self.oom,
            "fits": None if self.gpu is None else self.fits(),
            "workspaces": [[name, size] for name, size in self.workspaces],
            "fsdp_units": list(self.fsdp_units),
            "bounds": {name: list(pair) for name, pair in self.bounds.items()},
            "causes": [c.to_dict() for c in self.causes],
            "host_peak": self.host_peak,
            "report": self.report.to_dict(),
            "notes": list(self.notes),
        }

    def headline(self) -> str:
        """ "predicted for <GPU> · fits" (or "· does NOT fit"), as text and HTML show it."""
        where = "no particular GPU" if self.gpu is None else self.gpu.describe()
        verdict = ""
        if self.gpu is not None:
            verdict = " · fits" if self.fits() else " · does NOT fit"
        return f"predicted for {where}{verdict}"

    def text(self) -> str:
        ranges = "".join(f"\n  {line}" for line in self.range_lines())
        return f"{self.headline()}{ranges}\n{self.report.text()}"

    def __repr__(self) -> str:
        return self.text()

    def html(self) -> str:
        # the verdict first: the report itself has no room for it
        ranges = "".join(f"\n{note(line)}" for line in self.range_lines())
        return f"{heading(self.headline())}{ranges}\n{self.report.html()}"

    def plot(self, ax: Any = None) -> Any:
        """The predicted timeline (the allocator model's allocated bytes through the step)."""
        return self.report.plot(ax)

    def to_snapshot(self, path: str | Path) -> Path:
        """The predicted timeline as a PyTorch memory snapshot (see `MemoryReport.to_snapshot`)."""
        return self.report.to_snapshot(path)

    def _ipython_display_(self) -> None:
        """In a notebook: the report, then its timeline, as the estimator's docs promise."""
        from IPython.display import Image, display

        from memlab.reports.plot import png

        display({"text/html": self._repr_html_(), "text/plain": self.text()}, raw=True)
        timeline = self.report.timeline
        if timeline is not None and len(timeline):
            display(Image(data=png(self.plot()), format="png"))
