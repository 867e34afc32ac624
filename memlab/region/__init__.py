"""``memlab.track``: measure a region of code, the one entry point every front end uses."""

from memlab.region.assemble import MAX_TIMELINE_POINTS
from memlab.region.measure import track

__all__ = ["MAX_TIMELINE_POINTS", "track"]
