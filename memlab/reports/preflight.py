"""A cell's pre-flight on a GPU (`Preflight`): the cell ran on the CPU and its allocations were
replayed through the allocator model of a GPU. Plain data and its renderings only:
`memlab.estimate.preflight` computes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memlab.reports.frame import heading, warning
from memlab.reports.oom import OOMExplanation
from memlab.reports.protocol import Result
from memlab.reports.units import fmt_bytes


@dataclass(frozen=True)
class Preflight(Result):
    """A cell tracked on the CPU and replayed through the allocator model of a GPU: would it
    have run out of memory there, and where."""

    css = "memlab-preflight"

    gpu: str  # "T4 (16 GiB)"
    usable: int
    #: Up to the first failure, if any.
    peak_allocated: int
    #: The cell's peak reserved bytes; when it does not fit, on a card without a limit (what it
    #: would need).
    peak_reserved: int
    #: The explanation of the first simulated out-of-memory; None when the cell fits.
    oom: OOMExplanation | None = None
    #: What the cell raised, if it did not run to its end (the verdict covers it up to there).
    raised: str | None = None
    #: Ops or allocations the accounting failed to take in: the replay may miss allocations or
    #: frees, so no verdict is given (the cell's report notes say why).
    lost: int = 0
    #: Where what earlier cells left on the device does not fit on the card by itself: its
    #: bytes (the cell could not begin); else 0.
    before: int = 0
    #: The line of the cell's ``except`` that catches the predicted out-of-memory error: on the
    #: GPU that branch would run, which the CPU run never did (`memlab.estimate.catches`).
    caught_at: int | None = None

    @property
    def fits(self) -> bool:
        """True only when the replay saw every op and allocation, and none ran out of memory."""
        return self.oom is None and not self.lost

    def headline(self) -> str:
        if self.lost:
            return (
                f"pre-flight on {self.gpu}: NO VERDICT: memlab lost track of {self.lost} of "
                f"this cell's ops or allocations (the report's notes say why), so it cannot say "
                f"whether the cell fits · peak reserved seen {fmt_bytes(self.peak_reserved)} of "
                f"{fmt_bytes(self.usable)} usable"
            )
        if self.oom is None:
            fits = "fits" if self.raised is None else f"fits up to where it raised {self.raised}"
            return (
                f"pre-flight on {self.gpu}: {fits} · peak reserved "
                f"{fmt_bytes(self.peak_reserved)} of {fmt_bytes(self.usable)} usable"
            )
        if self.before:
            return (
                f"pre-flight on {self.gpu}: would run OUT OF MEMORY before this cell begins: "
                f"{fmt_bytes(self.before)} left by earlier cells does not fit in "
                f"{fmt_bytes(self.usable)} usable · the cell with it needs "
                f"{fmt_bytes(self.peak_reserved)}"
            )
        at = f" at line {self.oom.line}" if self.oom.line is not None else ""
        caught = (
            ""
            if self.caught_at is None
            else f" · the cell catches it at line {self.caught_at}: on the GPU that except "
            "branch would run from there, and this replay on the CPU never ran it"
        )
        return (
            f"pre-flight on {self.gpu}: would run OUT OF MEMORY{at} "
            f"({fmt_bytes(self.oom.requested)} requested) · needs "
            f"{fmt_bytes(self.peak_reserved)} of {fmt_bytes(self.usable)} usable{caught}"
        )

    def text(self) -> str:
        # the explanation under the verdict, without a second headline saying the same
        shown = self.oom is not None and not self.lost
        return self.headline() + ("\n" + self.oom.body_text() if shown and self.oom else "")

    def html(self) -> str:
        if self.lost:
            return warning(self.headline())
        if self.oom is None:
            return heading(self.headline(), "allocator model; the cell ran on the CPU")
        return f"{warning(self.headline())}\n{self.oom.body_html()}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "usable": self.usable,
            "fits": self.fits,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "oom": None if self.oom is None else self.oom.to_dict(),
            "raised": self.raised,
            "lost": self.lost,
            "before": self.before,
            "caught_at": self.caught_at,
        }
