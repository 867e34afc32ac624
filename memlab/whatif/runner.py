"""Kept for one release: moved to `memlab.step` (`run`, `RunResult`, `blocks`)."""

from memlab.core.warn import moved
from memlab.step.config import AMP_DTYPES
from memlab.step.model import blocks, resolve_device
from memlab.step.result import RunResult
from memlab.step.run import StepHooks, run
from memlab.step.user import InputFn, LossFn, ModelFn

moved("memlab.whatif.runner", "memlab.step (or memlab.whatif)")

__all__ = [
    "AMP_DTYPES",
    "InputFn",
    "LossFn",
    "ModelFn",
    "RunResult",
    "StepHooks",
    "blocks",
    "resolve_device",
    "run",
]
