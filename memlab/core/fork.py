"""A process forked inside a region (a DataLoader's workers, a multiprocessing pool started
with fork) starts without memlab's dispatch modes. The child inherits the forking thread's
state, the region's mode among it: left on, it would run memlab's accounting on every op the
child runs (a worker's collate), into a copy of the ledger that nobody reads. The native
record takes its dispatch key off the child the same way (``record.cpp``'s fork handlers). The
child's ledger starts afresh."""

from __future__ import annotations

import contextlib
import os

from memlab.core import ledger
from memlab.core._torch import OwnedMode, dispatch_mode_stack


def _in_child() -> None:
    with contextlib.suppress(Exception):  # never stop a child from starting
        for mode in dispatch_mode_stack():
            if isinstance(mode, OwnedMode):
                mode.__exit__(None, None, None)
    # The child's own ledger starts empty: the parent's storages are not the child's work (a
    # rank that `memlab.distributed.launch` forked from a notebook measured the notebook's
    # tensors from tracked cells), and a lock another thread held at the fork stays held.
    ledger._DEFAULT = None


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_in_child)
