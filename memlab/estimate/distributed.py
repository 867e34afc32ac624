"""Per-GPU memory of data-parallel training over N GPUs, on paper, from one estimate.

Each GPU (rank) runs the estimated step on its own batch, so what scales with the batch is the
same on every rank; what data parallelism changes is where the model's state lives:

- ``ddp``: every rank holds all parameters, gradients and optimizer state. DDP also keeps its
  gradient buckets, flat buffers as large as all the gradients together (unless the model is
  wrapped with ``gradient_as_bucket_view=True``, which makes the gradients views of them).
- ``zero1``: the optimizer state is sharded: each rank keeps ``1/N`` of it.
- ``zero2``: gradients are sharded too (reduce-scattered as backward produces them).
- ``zero3`` / ``fsdp`` (full sharding): parameters too; a rank gathers one unit's parameters at a
  time (here: each repeated block, as checkpointing "auto" finds them) and, with prefetching,
  the next unit's while it computes, and holds a unit's full gradients until they are
  reduce-scattered.

The figures apply these rules to the categories of the step's peak; they do not model the
communication libraries' own buffers (NCCL), the moment of the peak moving when the state
shrinks, or the allocator's cache. They are for planning, not for promises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memlab.core.categories import Category
from memlab.estimate.result import Estimate
from memlab.reports.frame import NAME, heading, note, num_cell, table, text_cell
from memlab.reports.protocol import Result
from memlab.reports.units import fmt_bytes

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
STATE = (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds at the step's peak under a strategy, by category (bytes)."""

    strategy: str
    world_size: int
    by_category: dict[Category, int]
    #: Buffers the strategy adds: DDP's buckets, FSDP's gathered units.
    extra: int
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total(self) -> int:
        return sum(self.by_category.values()) + self.extra

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "by_category": {c.value: b for c, b in self.by_category.items()},
            "extra": self.extra,
            "total": self.total,
            "notes": list(self.notes),
        }


def per_rank(
    estimate: Estimate, world_size: int, strategy: str = "ddp", *, bucket_view: bool = False
) -> RankMemory:
    """One rank's memory at the step's peak for ``strategy`` over ``world_size`` GPUs."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number ≥ 1, not {world_size!r}.")
    breakdown = estimate.tensors.breakdown
    if breakdown is None:
        raise ValueError("the estimate has no breakdown to divide.")
    at_peak = dict(breakdown.at_peak)
    n = world_size
    sharded = {
        "ddp": (),
        "zero1": (Category.OPTIMIZER_STATE,),
        "zero2": (Category.OPTIMIZER_STATE, Category.GRADIENT),
        "zero3": STATE,
        "fsdp": STATE,
    }[strategy]
    by_category = {c: -(-b // n) if c in sharded else b for c, b in at_peak.items() if b}
    notes = []
    extra = 0
    if strategy == "ddp" and not bucket_view:
        extra = breakdown.highest.get(Category.GRADIENT, 0)
        notes.append("DDP's gradient buckets: as large as the gradients")
    if strategy in ("zero3", "fsdp") and n > 1:
        unit = max(estimate.fsdp_units, default=breakdown.highest.get(Category.PARAMETER, 0))
        extra = 3 * unit  # the unit gathered, the next one prefetched, one unit's full gradients
        notes.append(f"gathered units: 3 × the largest unit's parameters ({fmt_bytes(unit)})")
    return RankMemory(strategy, n, by_category, extra, tuple(notes))


#: The categories a table shows, in order (those no strategy holds any of are left out).
SHOWN = (*STATE, Category.ACTIVATION, Category.TEMPORARY, Category.INPUT)


@dataclass(frozen=True)
class StrategyTable(Result):
    """One rank's memory at the step's peak under each strategy (`strategies`); ``rows`` holds
    the per-rank figures (`RankMemory`), one per strategy."""

    css = "memlab-strategies"

    world_size: int
    rows: tuple[RankMemory, ...]

    @property
    def categories(self) -> list[Category]:
        return [c for c in SHOWN if any(r.by_category.get(c) for r in self.rows)]

    def table(self) -> str:
        """The figures alone, as `compare` returned them."""
        n = self.world_size
        lines = [
            f"{'per rank, ' + str(n) + ' GPUs':22}"
            + "".join(f"{r.strategy:>11}" for r in self.rows)
        ]
        for c in self.categories:
            lines.append(
                f"{c.value:22}"
                + "".join(f"{fmt_bytes(r.by_category.get(c, 0)):>11}" for r in self.rows)
            )
        lines.append(
            f"{'strategy buffers':22}" + "".join(f"{fmt_bytes(r.extra):>11}" for r in self.rows)
        )
        lines.append(f"{'total':22}" + "".join(f"{fmt_bytes(r.total):>11}" for r in self.rows))
        return "\n".join(lines)

    def notes(self) -> list[str]:
        return [f"{r.strategy}: {n}" for r in self.rows for n in r.notes]

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "strategies": [r.to_dict() for r in self.rows]}

    def text(self) -> str:
        return "\n".join([self.table(), *(f"  note: {n}" for n in self.notes())])

    def html(self) -> str:
        def line(name: str, figures: list[int], bold: bool = False) -> str:
            style = f"{NAME};font-weight:600" if bold else NAME
            return text_cell(name, style) + "".join(num_cell(b) for b in figures)

        rows = [
            line(c.value, [r.by_category.get(c, 0) for r in self.rows]) for c in self.categories
        ]
        rows.append(line("strategy buffers", [r.extra for r in self.rows]))
        rows.append(line("total", [r.total for r in self.rows], bold=True))
        head = heading(
            f"per rank, {self.world_size} GPUs", "data parallelism on paper, at the step's peak"
        )
        body = table(["", *(r.strategy for r in self.rows)], rows, "memlab-strategies-table")
        return "\n".join([head, body, *(note(n) for n in self.notes())])


def strategies(estimate: Estimate, world_size: int) -> StrategyTable:
    """One rank's memory under every strategy (ddp, zero1, zero2, fsdp) over ``world_size``
    GPUs: ``.rows`` holds each strategy's `RankMemory`; display it, print it or ``.to_dict()``."""
    rows = [per_rank(estimate, world_size, s) for s in STRATEGIES if s != "zero3"]
    return StrategyTable(world_size, tuple(rows))


def compare(estimate: Estimate, world_size: int) -> str:
    """Kept for one release: use `strategies`, whose result prints the same table (with notes),
    shows as HTML in a notebook and has ``.to_dict()``. Returns the plain-text table."""
    from memlab.core.warn import moved

    moved("memlab.estimate.compare", "memlab.estimate.strategies")
    return strategies(estimate, world_size).table()
