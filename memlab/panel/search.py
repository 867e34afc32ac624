"""The largest batch that fits: its home is `memlab.estimate.search` (the estimator's
`fit_generation` searches with it too); kept importable from here, where the panel uses it."""

from memlab.estimate.search import MAX_BATCH, MAX_JUMP, largest_batch, predicted_batch

__all__ = ["MAX_BATCH", "MAX_JUMP", "largest_batch", "predicted_batch"]
