"""What-if runs: the public name of `memlab.step` (one training or inference step under a
configuration, measured and compared). ``memlab.whatif.run`` and ``RunConfig`` stay here."""

from memlab.step import *  # noqa: F403  (the same names)
from memlab.step import __all__ as __all__
