"""`StepHooks`: what differs when a step is predicted rather than measured (the estimator sets
them; `memlab.step.run` never imports the estimator)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memlab.reports.oom import OOMExplanation
from memlab.step.config import RunConfig

Autocast = Callable[[torch.dtype], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True)
class StepHooks:
    """How a step runs where it is not measured but predicted (the estimator sets these).

    autocast: makes the AMP context for a dtype (None: ``torch.autocast`` on the run's device).
    foreach: the optimizer's ``foreach`` option (None: PyTorch's default for the device).
    grad_scaler: whether fp16 training uses a gradient scaler.
    on_measure: called with "start" just before the measured step's region, "opened" as its
        clock starts, and "end" just after it.
    on_oom(error, config, device): an out-of-memory explained (`RunResult.explanation`), called
        before the failed step's tensors are released (the estimator's `run_levers` makes one).
    since: the measured region leaves out the storages from before this ledger serial that it
        never touches (`memlab.track`'s ``since``; an estimate's simulated GPU starts empty).
    """

    autocast: Autocast | None = None
    foreach: bool | None = None
    grad_scaler: bool = True
    on_measure: Callable[[str], None] | None = None
    on_oom: Callable[[BaseException, RunConfig, str], OOMExplanation | None] | None = None
    since: int = 0
