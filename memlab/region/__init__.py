"""``memlab.track``: measure a region of code, the one entry point every front end uses."""

from typing import Any

from memlab.core.parts import part
from memlab.region.assemble import MAX_TIMELINE_POINTS
from memlab.region.measure import track

__all__ = ["MAX_TIMELINE_POINTS", "track"]


def __getattr__(name: str) -> Any:  # (its modules, imported when first asked for)
    return part(__name__, __file__, name)
