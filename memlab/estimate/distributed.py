"""Per-GPU memory of data-parallel training over N GPUs, on paper, from one estimate.

Each GPU (rank) runs the estimated step on its own batch, so what scales with the batch is the
same on every rank; what data parallelism changes is where the model's state lives:

- ``ddp``: every rank holds all parameters, gradients and optimizer state. DDP also keeps its
  gradient buckets, flat buffers as large as all the gradients together (unless the model is
  wrapped with ``gradient_as_bucket_view=True``, which makes the gradients views of them).
- ``zero1``: the optimizer state is sharded: each rank keeps ``1/N`` of it (and the optimizer's
  temporaries shrink with it); DDP's buckets stay (PyTorch's ``ZeroRedundancyOptimizer``).
- ``zero2``: gradients are sharded too (reduce-scattered as backward produces them).
- ``zero3`` / ``fsdp`` (full sharding): parameters too. A rank gathers one unit's parameters at
  a time (here: each repeated block, as checkpointing "auto" finds them), and the next unit's
  while it computes: two units gathered, in two all-gather buffers. Without
  ``reshard_after_forward`` every unit stays gathered from its forward to its backward.

A rank's peak is the larger of two moments of the step: the optimizer step (the whole state,
sharded by the strategy, and the optimizer's temporaries) and forward and backward (the
parameters and optimizer state, the activations, the gathered units). The estimate's own peak
gives the categories of the moment it falls in; the other moment is built from the highest
figure of each category. Checked against 2-rank CPU
jobs measured by `memlab.distributed` (benchmarks/RESULTS.md). Not modelled: the communication
libraries' own buffers (NCCL), the allocator's cache on each rank. The rule lives in
`memlab.step.ranks` (what-if runs with a ``world_size`` use it too); its names stay importable here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from memlab.core.categories import Category
from memlab.core.frames import users_traceback
from memlab.estimate.result import Estimate
from memlab.reports.frame import NAME, heading, note, num_cell, table, text_cell
from memlab.reports.protocol import Result
from memlab.reports.units import fmt_bytes
from memlab.step.ranks import FORWARD, SHARDED, STATE, STEP, STRATEGIES, RankMemory, divide

__all__ = [
    "FORWARD",
    "SHARDED",
    "STATE",
    "STEP",
    "STRATEGIES",
    "WORKSPACES",
    "RankMemory",
    "StrategyTable",
    "compare",
    "model_states",
    "per_rank",
    "strategies",
]


@users_traceback()
def per_rank(
    estimate: Estimate,
    world_size: int,
    strategy: str = "ddp",
    *,
    bucket_view: bool = False,
    reshard_after_forward: bool = True,
) -> RankMemory:
    """One rank's memory at its peak for ``strategy`` over ``world_size`` GPUs (the rule:
    `memlab.step.ranks.divide`, with the estimate's breakdown and FSDP units)."""
    if not isinstance(estimate, Estimate):
        raise TypeError(
            f"estimate got {type(estimate).__name__} {estimate!r:.60}: pass what "
            "memlab.estimate.estimate(...) returned."
        )
    breakdown = estimate.tensors.breakdown
    if breakdown is None:
        raise ValueError("the estimate has no breakdown to divide.")
    rank = divide(
        breakdown,
        estimate.fsdp_units,
        world_size,
        strategy,
        bucket_view=bucket_view,
        reshard_after_forward=reshard_after_forward,
    )
    if not estimate.workspace:
        return rank
    # each rank's GPU keeps its own cuBLAS workspaces, as one GPU does: in the rank's total
    # (on one GPU they are outside the tensors' breakdown, in the estimate's peak)
    held = {**rank.by_category}
    held[Category.UNATTRIBUTED] = held.get(Category.UNATTRIBUTED, 0) + estimate.workspace
    said = f"{WORKSPACES}{fmt_bytes(estimate.workspace)} on every rank (as on one GPU)"
    return replace(rank, by_category=held, notes=(*rank.notes, said))


#: How a rank's note on its cuBLAS workspaces begins (`memlab.distributed.check` reads it).
WORKSPACES = "cuBLAS workspaces: "
#: The categories a table shows, in this order, then any other a row holds (those no strategy
#: holds any of are left out): the rows add up to the total.
SHOWN = (
    *STATE,
    Category.ACTIVATION,
    Category.KV_CACHE,
    Category.TEMPORARY,
    Category.INPUT,
    Category.UNATTRIBUTED,
)


@dataclass(frozen=True)
class StrategyTable(Result):
    """One rank's memory at the step's peak under each strategy (`strategies`); ``rows`` holds
    the per-rank figures (`RankMemory`), one per strategy."""

    css = "memlab-strategies"

    world_size: int
    rows: tuple[RankMemory, ...]

    @property
    def categories(self) -> list[Category]:
        order = [*SHOWN, *(c for c in Category if c not in SHOWN)]
        return [c for c in order if any(r.by_category.get(c) for r in self.rows)]

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
        # a note every strategy has (the workspaces) once, the others by strategy
        first = self.rows[0].notes if self.rows else ()
        common = [n for n in first if all(n in r.notes for r in self.rows)]
        own = [f"{r.strategy}: {n}" for r in self.rows for n in r.notes if n not in common]
        return [*common, *own] if len(self.rows) > 1 else own

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


@users_traceback()
def strategies(estimate: Estimate, world_size: int) -> StrategyTable:
    """One rank's memory under every strategy (ddp, zero1, zero2, fsdp) over ``world_size``
    GPUs: ``.rows`` holds each strategy's `RankMemory`; display it, print it or ``.to_dict()``."""
    rows = [per_rank(estimate, world_size, s) for s in STRATEGIES if s != "zero3"]
    return StrategyTable(world_size, tuple(rows))


@users_traceback()
def model_states(
    parameters: int,
    world_size: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
) -> StrategyTable:
    """The model states alone (parameters, gradients, optimizer state) of ``parameters``
    parameters per rank, unsharded and under each ZeRO stage, as the ZeRO paper counts them
    (Rajbhandari et al., 2020, Figure 1). The defaults are mixed-precision Adam: fp16
    parameters and gradients, and an fp32 copy of the parameters, momentum and variance
    (12 bytes a parameter)."""
    for name, value in (("parameters", parameters), ("world_size", world_size)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a whole number ≥ 1, not {value!r}.")
    sizes = {
        Category.PARAMETER: param_bytes * parameters,
        Category.GRADIENT: grad_bytes * parameters,
        Category.OPTIMIZER_STATE: optimizer_bytes * parameters,
    }
    rows = []
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        sharded = SHARDED[strategy]
        cats = {c: -(-b // world_size) if c in sharded else b for c, b in sizes.items()}
        rows.append(RankMemory(strategy, world_size, cats, 0))
    return StrategyTable(world_size, tuple(rows))


@users_traceback()
def compare(estimate: Estimate, world_size: int) -> str:
    """Kept for one release: use `strategies`, whose result prints the same table (with notes),
    shows as HTML in a notebook and has ``.to_dict()``. Returns the plain-text table."""
    from memlab.core.warn import moved

    moved("memlab.estimate.compare", "memlab.estimate.strategies")
    return strategies(estimate, world_size).table()
