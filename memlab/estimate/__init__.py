"""The estimator: what a step would need on a GPU, computed without one (see `estimate`)."""

from typing import Any

from memlab.core.parts import part
from memlab.estimate.after_oom import after_oom
from memlab.estimate.distributed import (
    RankMemory,
    StrategyTable,
    compare,
    model_states,
    per_rank,
    strategies,
)
from memlab.estimate.fit_result import GenerationFit
from memlab.estimate.generation import fit_generation
from memlab.estimate.gpus import GPU, GPUS
from memlab.estimate.predict import estimate
from memlab.estimate.result import Estimate

__all__ = [
    "GPU",
    "GPUS",
    "Estimate",
    "GenerationFit",
    "RankMemory",
    "StrategyTable",
    "after_oom",
    "compare",
    "estimate",
    "fit_generation",
    "model_states",
    "per_rank",
    "strategies",
]


def __getattr__(name: str) -> Any:  # (its modules, imported when first asked for)
    return part(__name__, __file__, name)
