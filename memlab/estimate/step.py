"""Kept for one release: moved to `memlab.estimate.predict` (`estimate`), `.result`
(`Estimate`) and `.redirect` (`redirected`)."""

from memlab.core.warn import moved
from memlab.estimate.predict import estimate
from memlab.estimate.redirect import redirected
from memlab.estimate.result import Estimate

moved("memlab.estimate.step", "memlab.estimate (estimate, Estimate) and memlab.estimate.redirect")

__all__ = ["Estimate", "estimate", "redirected"]
