"""What-if runs: the public name of `memlab.step` (one training or inference step under a
configuration, measured and compared). ``memlab.whatif.run`` and ``RunConfig`` stay here."""

from memlab.step import (
    Amp,
    Comparison,
    Mode,
    Optimizer,
    Retention,
    RunConfig,
    RunResult,
    StepHooks,
    WhatIfError,
    blocks,
    run,
)

__all__ = [
    "Amp",
    "Comparison",
    "Mode",
    "Optimizer",
    "Retention",
    "RunConfig",
    "RunResult",
    "StepHooks",
    "WhatIfError",
    "blocks",
    "run",
]
