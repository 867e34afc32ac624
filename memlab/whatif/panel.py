"""Kept for one release: moved to `memlab.panel`."""

from memlab.panel import Explorer
from memlab.panel.explorer import CUSTOM, HERE
from memlab.panel.search import MAX_BATCH

__all__ = ["CUSTOM", "HERE", "MAX_BATCH", "Explorer"]
