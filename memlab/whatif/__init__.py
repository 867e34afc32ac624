"""What-if runs: one training or inference step under a configuration, measured and compared."""

from memlab.whatif.config import RunConfig, WhatIfError
from memlab.whatif.runner import RunResult, run

__all__ = ["RunConfig", "RunResult", "WhatIfError", "run"]
