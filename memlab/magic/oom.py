"""The magic's side of an out-of-memory: ``--gpu`` pre-flight and a real OOM explained.

Both are the estimator's work, which sits on a floor above the magic: ``load`` passes its two
functions in (``preflight`` and ``after_oom``, from the package root), and this module only
calls them and shows what they return.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.display import display

from memlab.magic.out_name import UNBOUND, store


class OOMHooks:
    """``preflight(spec, namespace, hidden)`` returns a flight (``start(filename)``,
    ``stop()`` → a result); ``after_oom(error, device, namespace, hidden)`` a result or None."""

    def __init__(self, preflight: Any = None, after_oom: Any = None) -> None:
        self.preflight, self.after_oom = preflight, after_oom

    def flight(self, gpu: str | None, shell: Any) -> Any:
        """``--gpu``: the replay of the cell through that GPU's allocator model, or None."""
        if gpu is None:
            return None
        if self.preflight is None:
            raise UsageError("%gpumem --gpu needs the extension loaded by %load_ext memlab.")
        try:
            return self.preflight(gpu, shell.user_ns, shell.user_ns_hidden)
        except ValueError as e:
            raise UsageError(f"%gpumem {e}") from None

    def land(
        self,
        flight: Any,
        opts: Any,
        shell: Any,
        raised: BaseException | None = None,
        lost: int = 0,
        before: Any = UNBOUND,
    ) -> None:
        """The pre-flight's verdict, shown before the cell's report (and its traceback), and
        kept in ``-o NAME``; ``lost``: ops the accounting failed to take in (no verdict)."""
        if flight is None:
            return
        try:
            result = flight.stop(None if raised is None else type(raised).__name__, lost)
        except Exception as e:  # never hide the cell's own outcome behind ours
            print(f"memlab: no pre-flight for this cell: {e}.")
            return
        store(opts.out, shell.user_ns, result, before, "%gpumem")
        if not opts.quiet:
            display(result)

    def explain(self, e: BaseException, device: str, shell: Any, quiet: bool) -> None:
        """An out-of-memory explained, shown before the report and the traceback."""
        if self.after_oom is None or not isinstance(e, torch.cuda.OutOfMemoryError):
            return
        try:
            found = self.after_oom(e, device, shell.user_ns, shell.user_ns_hidden)
        except Exception as err:  # never hide the cell's own error behind ours
            print(f"memlab: could not explain this out-of-memory: {err}.")
            return
        if found is not None and not quiet:
            display(found)


def release(e: BaseException) -> None:
    """After an out-of-memory, the failed frames' variables (a half-done forward's tensors) die
    now rather than with the next error, so the next cell has the memory back. The cell's own
    variables (its namespace) are kept; the traceback keeps its lines."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        traceback.clear_frames(e.__traceback__)
