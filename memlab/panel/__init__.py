"""The what-if panel: ipywidgets controls over `memlab.step.run` and the estimator."""

from memlab.panel.explorer import Explorer
from memlab.panel.search import largest_batch

__all__ = ["Explorer", "largest_batch"]
