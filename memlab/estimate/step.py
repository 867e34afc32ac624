"""Kept for one release: moved to `memlab.estimate.predict` (`estimate`), `.result`
(`Estimate`) and `.redirect` (`redirected`)."""

from memlab.estimate.predict import estimate
from memlab.estimate.redirect import redirected
from memlab.estimate.result import Estimate

__all__ = ["Estimate", "estimate", "redirected"]
