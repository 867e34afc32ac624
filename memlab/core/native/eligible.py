"""Whether a region can be measured by the native record here (`memlab.core.native.region`)."""

from __future__ import annotations

from typing import Any

import torch

from memlab.core import _torch
from memlab.core._torch_record import can_force_eager, dispatch_modes_on, force_eager
from memlab.core.ledger import Ledger, default_ledger
from memlab.core.native import disable, enabled, library, settled
from memlab.core.native.check import self_check


def eligible(ledger: Ledger) -> bool:
    """Whether a CPU region can be measured natively here: the library loads, the region uses
    the process's ledger and nothing else listens to it (the pre-flight's replay of each
    allocation, stamped with its cell line, hears ops only under the dispatch mode), no
    dispatch mode is active (memlab's own or the program's: fake tensors and the like are
    counted as the dispatch mode counts them), compiled functions can be made to run eagerly
    (as under a dispatch mode), and no process group is up (collectives are followed by the
    dispatch mode's accounting only)."""
    if ledger is not default_ledger() or ledger._listeners or dispatch_modes_on():
        return False
    if not enabled():
        return False
    if _dist_up():
        return False
    return _static_ok()


def _static_ok() -> bool:
    ok = _STATIC.get("ok")
    if ok is not None:
        return ok
    if not can_force_eager():
        _STATIC["ok"] = False
        return False
    lib = library(wait=False)  # never waits for the compiler
    if lib is not None:
        why = self_check(lib)  # once a process: the same figures as the dispatch mode's
        if why is not None:
            disable(why)
        _STATIC["ok"] = why is None
        return why is None
    if settled():  # tried and failed: no need to ask again
        _STATIC["ok"] = False
    return False


_STATIC: dict[str, bool] = {}


def _dist_up() -> bool:
    dist = getattr(torch, "distributed", None)
    return dist is not None and dist.is_available() and dist.is_initialized()


def eager() -> Any:
    """``force_eager``, or NativeNotStartedError inside a compiled region (where the stance
    cannot change): the dispatch mode measures there."""
    try:
        return force_eager()
    except RuntimeError as e:
        raise NativeNotStartedError(4) from e


def modes_left_on() -> list[str]:
    """The note on the dispatch modes a region's code entered and left on (none was on when
    the region opened; memlab's own, another region's, are not the code's)."""
    if not dispatch_modes_on():
        return []
    names = ", ".join(
        t.__name__ for t in map(type, _torch.dispatch_mode_stack()) if t.__module__[:7] != "memlab."
    )
    return [f"dispatch mode(s) the code entered and left on: {names}"] if names else []


class NativeNotStartedError(RuntimeError):
    def __init__(self, code: int) -> None:
        super().__init__(f"the native record did not start (code {code})")
        self.code = code
