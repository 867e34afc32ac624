"""Kept for one release: moved to `memlab.step.config`."""

from memlab.core.warn import moved
from memlab.step.config import (
    AMP,
    MODES,
    OPTIMIZERS,
    RETENTION,
    Amp,
    Mode,
    Optimizer,
    Retention,
    RunConfig,
    WhatIfError,
)

moved("memlab.whatif.config", "memlab.step.config (or memlab.whatif)")

__all__ = [
    "AMP",
    "MODES",
    "OPTIMIZERS",
    "RETENTION",
    "Amp",
    "Mode",
    "Optimizer",
    "Retention",
    "RunConfig",
    "WhatIfError",
]
