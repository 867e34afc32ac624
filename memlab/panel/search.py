"""The largest batch that fits: its home is `memlab.estimate.search` (the estimator's
`fit_generation` searches with it too); kept importable from here, where the panel uses it.
`Tries` is the panel's side of a search: each batch's step, run once, and where the search
starts."""

from __future__ import annotations

from collections.abc import Callable

from memlab.core.frames import described
from memlab.estimate.search import MAX_BATCH, MAX_JUMP, largest_batch, predicted_batch
from memlab.panel.ranks import fit_and_peak
from memlab.step import RunResult, WhatIfError

__all__ = ["MAX_BATCH", "MAX_JUMP", "Tries", "largest_batch", "predicted_batch"]


class Tries:
    """The steps a search for the largest batch runs, each batch once (``done``: the winner
    joins the comparison without running again).

    The search chooses its batches itself, so a step that raises says which batch the search
    tried. Its first try, the smallest batch (``step``), may raise where a larger one runs: a
    BatchNorm layer in training needs more than one value per channel. Then it tries ``2 *
    step`` and the panel's own batch (``batch``), and starts at the first that runs; the
    smaller batches count as not fitting, and the answer says why the search started there.
    """

    def __init__(self, run_step: Callable[[int], RunResult], step: int, batch: int) -> None:
        self._run_step = run_step
        #: Called before each of the first tries, as the search's ``on_try`` (progress).
        self.on_try: Callable[[int, int, int | None], None] | None = None
        self.step = step
        self.done: dict[int, RunResult] = {}
        self.floor = step  # the smallest batch the step runs at
        self.skipped = ""  # why the search started above ``step``
        larger = batch // step * step
        self._starts = sorted({step, 2 * step, *([larger] if larger > 2 * step else [])})

    def first(self) -> tuple[int, int]:
        """The search's two first tries, from the smallest batch that runs (tried here)."""
        error: Exception | None = None
        for batch in self._starts:
            if self.on_try is not None:
                self.on_try(batch, 0, None)
            try:
                self.measure(batch)
            except Exception as e:  # the next start, or the first error said at the end
                error = error or e
                continue
            if batch > self.step and error is not None:
                self.floor = batch
                self.skipped = f"batch {self.step:,} raised {_short(_cause(error))}"
            return batch, 2 * batch
        assert error is not None
        tried = " and ".join(f"{b:,}" for b in self._starts[1:])
        raise WhatIfError(
            f"the search for the largest batch tried batch {self.step:,} first, then {tried}, "
            f"and the step raised at each: at batch {self.step:,}, {_text(error)}"
        ) from error

    def measure(self, batch: int) -> tuple[bool, int | None]:
        """Whether the step at ``batch`` fits, and its peak (`fit_and_peak`); a batch below
        the one the search started at does not run, so it does not fit."""
        if batch < self.floor:
            return False, None
        if batch not in self.done:
            try:
                self.done[batch] = self._run_step(batch)
            except Exception as e:
                if batch in self._starts and not self.done:
                    raise  # said by `first`, with the other starts' tries
                raise WhatIfError(
                    f"the search for the largest batch tried batch {batch:,}, and the step "
                    f"raised: {_text(e)}"
                ) from e
        return fit_and_peak(self.done[batch])


def _text(e: BaseException) -> str:
    """What a step raised: a WhatIfError's own sentence, else the kind and the message."""
    return str(e) if isinstance(e, WhatIfError) else described(e)


def _cause(e: BaseException) -> BaseException:
    """What the step raised at its root: the error a WhatIfError explains, if any."""
    cause = e.__cause__
    return cause if isinstance(e, WhatIfError) and isinstance(cause, Exception) else e


def _short(e: BaseException) -> str:
    text = _text(e)
    return text if len(text) <= 200 else text[:199] + "…"
