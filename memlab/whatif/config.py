"""Kept for one release: moved to `memlab.step.config`."""

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
