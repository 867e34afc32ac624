"""One rank's memory under a data-parallel strategy, from one step's breakdown.

Each rank runs the step on its own batch (``batch_size`` is the batch of one rank), so what
scales with the batch is the same on every rank; what the strategy changes is where the model's
state lives (`SHARDED`). The rule is the estimator's (`memlab.estimate.per_rank`, which calls
`divide` with a predicted step); a what-if run with ``world_size`` > 1 applies it to the step it
measured in this one process (`of_run`). Either way the figures are derived, not measured on N
ranks: `memlab.distributed` measures a real job.

A rank's peak is the larger of two moments of the step: the optimizer step (the whole state,
sharded by the strategy, and the optimizer's temporaries) and forward and backward (the
parameters and optimizer state, the activations, the gathered units). The step's own peak gives
the categories of the moment it falls in; the other moment is built from the highest figure of
each category.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from memlab.core.categories import Category
from memlab.reports.report import Breakdown
from memlab.reports.units import fmt_bytes
from memlab.step.checkpoint import blocks
from memlab.step.config import RunConfig, Sharding, WhatIfError

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
STATE = (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)
#: What each strategy shards.
SHARDED = {
    "ddp": (),
    "zero1": (Category.OPTIMIZER_STATE,),
    "zero2": (Category.OPTIMIZER_STATE, Category.GRADIENT),
    "zero3": STATE,
    "fsdp": STATE,
}
STEP, FORWARD = "optimizer step", "forward and backward"
#: Each `Sharding` as the rule's strategy and whether FSDP reshards after forward.
RULE = {
    Sharding.DDP: ("ddp", True),
    Sharding.ZERO1: ("zero1", True),
    Sharding.ZERO2: ("zero2", True),
    Sharding.ZERO3: ("zero3", True),
    Sharding.FSDP: ("fsdp", True),
    Sharding.FSDP_NO_RESHARD: ("fsdp", False),
}


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds at its peak under a strategy, by category (bytes)."""

    strategy: str
    world_size: int
    by_category: dict[Category, int]
    #: Buffers the strategy adds: DDP's buckets, FSDP's gathered units (communication buffers).
    extra: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: When the peak falls: "optimizer step", or "forward and backward" (activations held).
    moment: str = STEP

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
            "moment": self.moment,
            "notes": list(self.notes),
        }


def divide(
    breakdown: Breakdown,
    units: Sequence[int],
    world_size: int,
    strategy: str = "ddp",
    *,
    bucket_view: bool = False,
    reshard_after_forward: bool = True,
) -> RankMemory:
    """One rank's memory at its peak for ``strategy`` over ``world_size`` ranks, from one
    step's ``breakdown``; ``units`` are the parameter bytes of each FSDP unit (each repeated
    block), the largest of which a rank gathers at a time."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number ≥ 1, not {world_size!r}.")
    n = world_size
    sharded = SHARDED[strategy]
    at_peak = {c: b for c, b in breakdown.at_peak.items() if b}
    highest = breakdown.highest

    # The step's own peak: in the optimizer step when no activation is alive at it; its
    # temporaries are then the optimizer's, which shrink with the optimizer state.
    in_step = not at_peak.get(Category.ACTIVATION)
    if in_step and Category.OPTIMIZER_STATE in sharded:
        sharded = (*sharded, Category.TEMPORARY)

    def share(c: Category, b: int) -> int:
        return -(-b // n) if c in sharded else b

    state = {c: highest.get(c, 0) for c in STATE}
    if in_step:
        step = {c: share(c, b) for c, b in at_peak.items()}
        forward = {c: share(c, state[c]) for c in (Category.PARAMETER, Category.OPTIMIZER_STATE)}
        forward[Category.ACTIVATION] = highest.get(Category.ACTIVATION, 0)
    else:
        forward = {c: share(c, b) for c, b in at_peak.items()}
        step = {c: share(c, b) for c, b in state.items()}
    notes = []
    buckets = 0
    if strategy in ("ddp", "zero1") and not bucket_view:
        buckets = highest.get(Category.GRADIENT, 0)
        notes.append("DDP's gradient buckets: as large as the gradients")
    gathered = 0
    if strategy in ("zero3", "fsdp") and n > 1:
        unit = max(units, default=highest.get(Category.PARAMETER, 0))
        held = 2 * unit if reshard_after_forward else state[Category.PARAMETER]
        gathered = held + 2 * unit
        what = "two units" if reshard_after_forward else "every unit (no reshard after forward)"
        notes.append(
            f"while activations are held: {what} gathered, and two all-gather buffers of the "
            f"largest unit ({fmt_bytes(unit)})"
        )
    cats, extra, moment = step, buckets, STEP
    if sum(forward.values()) + buckets + gathered > sum(step.values()) + buckets:
        cats, extra, moment = forward, buckets + gathered, FORWARD
    by_category = {c: b for c, b in cats.items() if b}
    return RankMemory(strategy, n, by_category, extra, tuple(notes), moment)


def units_of(model: nn.Module) -> tuple[int, ...]:
    """The parameter bytes of each repeated block (FSDP's units, as checkpoint "auto" finds
    them); empty when the model has none (the whole model is then one unit)."""
    named = dict(model.named_modules())
    return tuple(
        sum(p.numel() * p.element_size() for p in named[path].parameters())
        for path in blocks(model)
    )


def of_run(
    config: RunConfig, breakdown: Breakdown | None, units: Sequence[int]
) -> RankMemory | None:
    """One rank's memory for the run's ``world_size`` and ``sharding``, from the breakdown of
    the step this process ran (None for one rank, or without a breakdown)."""
    if config.world_size == 1 or breakdown is None:
        return None
    strategy, reshard = RULE[config.sharding]
    return divide(breakdown, units, config.world_size, strategy, reshard_after_forward=reshard)


def one_process(config: RunConfig) -> None:
    """For `memlab.estimate.estimate`, which predicts one process's whole step: a WhatIfError
    that says how to get one rank's figures when ``config`` asks for several ranks."""
    if config.world_size > 1:
        n, s = config.world_size, config.sharding
        raise WhatIfError(
            f"estimate() predicts the whole step in one process, and world_size={n}: estimate "
            f"with world_size=1, then per_rank(e, {n}, ...) gives one rank's figures (or use "
            f"memlab.whatif.run(..., world_size={n}, sharding={str(s)!r}) or the panel, which "
            "judge one rank)."
        )
