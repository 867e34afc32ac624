"""What-if runs: the public name of `memlab.step` (one training or inference step under a
configuration, measured and compared). ``memlab.whatif.run`` and ``RunConfig`` stay here."""

from typing import Any

from memlab.core.parts import part
from memlab.step import *  # noqa: F403  (the same names)
from memlab.step import __all__ as __all__


def __getattr__(name: str) -> Any:  # (its modules, imported when first asked for)
    return part(__name__, __file__, name)
