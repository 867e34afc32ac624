"""One training or inference step under a configuration, measured: the what-if runs.

`run` is what the panel's Run button, the estimator and programs call; `RunConfig` describes the
step (AMP, checkpointing, no_grad, batch, accumulation, optimizer).
"""

from typing import Any

from memlab.core.parts import part
from memlab.step.comparison import Comparison
from memlab.step.config import (
    Amp,
    Mode,
    Offload,
    Optimizer,
    Retention,
    RunConfig,
    Sharding,
    WhatIfError,
)
from memlab.step.model import blocks
from memlab.step.ranks import RankMemory
from memlab.step.result import RunResult
from memlab.step.run import StepHooks, run

__all__ = [
    "Amp",
    "Comparison",
    "Mode",
    "Offload",
    "Optimizer",
    "RankMemory",
    "Retention",
    "RunConfig",
    "RunResult",
    "Sharding",
    "StepHooks",
    "WhatIfError",
    "blocks",
    "run",
]


def __getattr__(name: str) -> Any:  # (its modules, imported when first asked for)
    return part(__name__, __file__, name)
