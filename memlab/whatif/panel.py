"""Kept for one release: moved to `memlab.panel`."""

from memlab.core.warn import moved
from memlab.panel import Explorer
from memlab.panel.controls import CUSTOM, HERE
from memlab.panel.search import MAX_BATCH

moved("memlab.whatif.panel", "memlab.panel (or memlab.Explorer)")

__all__ = ["CUSTOM", "HERE", "MAX_BATCH", "Explorer"]
