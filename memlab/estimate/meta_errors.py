"""What to tell a user whose step failed on the meta device: code that needs a tensor's values
(``.item()``, ``if x.sum() > 0``: `memlab.estimate.values`), or state made before the estimate
(an EMA copy of the model, a running total) that lives on a real device and meets the model,
which the estimate built on meta. Each message names the user's line."""

from __future__ import annotations

import linecache
import sys
import traceback
from pathlib import Path

import torch

from memlab.core.frames import message_of
from memlab.estimate.values import data_dependent

#: Where library code lives: frames there are not the user's.
_LIBRARIES = tuple(
    str(Path(m.__file__).parent) for m in (torch, sys.modules["memlab"]) if m.__file__
)

#: What PyTorch says when an op's tensors are on two devices (meta and a real one).
_TWO_DEVICES = ("not on the expected device", "same device", "to be on the same device")


def on_meta(e: BaseException) -> str | None:
    """The message for an error the user's code met on meta, or None if it is not one."""
    text = message_of(e)
    if not isinstance(e, (RuntimeError, NotImplementedError)) or "meta" not in text:
        return None
    said = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    if any(words in text for words in _TWO_DEVICES):
        return (
            f"the step mixes the model, which the estimate builds on the meta device, with a "
            f"tensor that already exists on a real device{_users_line(e)} ({said}). An estimate "
            "makes on meta only what model_fn, input_fn and the step make; state made before "
            "it (an EMA copy of the model, a running total kept in the notebook) stays where "
            "it is. Make that state from the model inside step_fn (e.g. an EMA copy made by "
            "`copy.deepcopy(model)` on the first call), or leave it out while estimating "
            "(`if not p.is_meta:`), or measure the step on a real device with "
            "memlab.whatif.run."
        )
    return data_dependent(e)


def _users_line(e: BaseException) -> str:
    """ " at FILE, line N: TEXT", the innermost frame of ``e`` outside torch and memlab."""
    for frame, line in reversed(list(traceback.walk_tb(e.__traceback__))):
        name = frame.f_code.co_filename
        if not any(name.startswith(d) for d in _LIBRARIES):
            text = linecache.getline(name, line).strip()
            return f" at {name}, line {line}" + (f": {text}" if text else "")
    return ""
