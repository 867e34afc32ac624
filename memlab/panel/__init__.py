"""The what-if panel: ipywidgets controls over `memlab.step.run` and the estimator."""

from typing import Any

from memlab.core.parts import part
from memlab.panel.explorer import Explorer
from memlab.panel.search import largest_batch

__all__ = ["Explorer", "largest_batch"]


def __getattr__(name: str) -> Any:  # (its modules, imported when first asked for)
    return part(__name__, __file__, name)
