"""The estimator: what a step would need on a GPU, computed without one (see `estimate`)."""

from memlab.estimate.distributed import (
    RankMemory,
    StrategyTable,
    compare,
    model_states,
    per_rank,
    strategies,
)
from memlab.estimate.gpus import GPU, GPUS
from memlab.estimate.predict import estimate
from memlab.estimate.result import Estimate

__all__ = [
    "GPU",
    "GPUS",
    "Estimate",
    "RankMemory",
    "StrategyTable",
    "compare",
    "estimate",
    "model_states",
    "per_rank",
    "strategies",
]
