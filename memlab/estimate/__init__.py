"""The estimator: what a step would need on a GPU, computed without one (see `estimate`)."""

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
