"""The estimator: what a step would need on a GPU, computed without one (see `estimate`)."""

from memlab.estimate.gpus import GPU, GPUS
from memlab.estimate.step import Estimate, estimate

__all__ = ["GPU", "GPUS", "Estimate", "estimate"]
