"""Measuring every rank of a ``torch.distributed`` job (DDP, FSDP2's ``fully_shard``).

Each rank measures its step with ``memlab.track``; `gather` brings the ranks' reports to rank 0
as JSON, into a `RankTable`; `launch` runs a function on N ranks from a notebook, a script, or
under ``torchrun``::

    def step(rank, world_size):
        model = ...  # DDP(...) or fully_shard(...)
        with memlab.track("cpu", breakdown=True, timeline=True, watch=[model, opt]) as t:
            model(x).sum().backward(); opt.step()
        return memlab.distributed.gather(t)

    table = memlab.distributed.launch(step, world_size=2)   # rank 0's RankTable

`check` sets the estimator's per-rank prediction (`memlab.estimate.per_rank`) beside it.
"""

from typing import Any

from memlab.core.parts import part
from memlab.distributed.check import Check, check
from memlab.distributed.gather import gather
from memlab.distributed.launch import RankError, launch
from memlab.distributed.table import RankDataError, RankRow, RankTable

__all__ = [
    "Check",
    "RankDataError",
    "RankError",
    "RankRow",
    "RankTable",
    "check",
    "gather",
    "launch",
]


def __getattr__(name: str) -> Any:  # (its modules, imported when first asked for)
    return part(__name__, __file__, name)
