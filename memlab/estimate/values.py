"""What to tell a user whose step needed a tensor's values on ``meta``, where tensors have
shapes but none: the line that asked (theirs, or a library's, which they cannot change), and
what to do."""

from __future__ import annotations

import linecache
import re
import site
import sys
import sysconfig
import traceback
from pathlib import Path
from types import FrameType

import torch

from memlab.core.frames import message_of

#: Where torch and memlab live: frames there are neither the user's nor a model library's.
_LIBRARIES = tuple(
    str(Path(m.__file__).parent) for m in (torch, sys.modules["memlab"]) if m.__file__
)


def data_dependent(e: BaseException) -> str:
    """What to tell a user whose code needed a tensor's values on ``meta`` (``.item()``,
    ``if x.sum() > 0``, ``.tolist()``, ``nonzero``), naming the line. A line in an installed
    library (a Hugging Face model's check of its labels, say) is said to be the library's,
    with the inputs it reads and what can be done from outside it."""
    where, library, read = "", None, []
    for frame, line in reversed(list(traceback.walk_tb(e.__traceback__))):
        name = frame.f_code.co_filename
        if not any(name.startswith(d) for d in _LIBRARIES):
            text = linecache.getline(name, line).strip()
            where = f" at {name}, line {line}" + (f": {text}" if text else "")
            library, read = installed(name), _tensors_read(frame, text)
            break
    said = f"the step needs a tensor's values{where} ({type(e).__name__}: "
    first = (message_of(e).splitlines() or [""])[0]  # (an error without a message has none)
    said += f"{first}). An estimate runs on the meta device, where tensors have shapes but "
    said += "no values: "
    if library is None:
        return said + (
            "make that code not depend on values while estimating (e.g. `if not x.is_meta:` "
            "around it, or a fixed number instead of `.item()`), or measure it on a real device "
            "with memlab.whatif.run."
        )
    names = " and ".join(f"`{n}`" for n in read) or "the input it reads"
    return said + (
        f"that line is in {library}, an installed library, not in your code. Leave out {names} "
        "in what input_fn returns "
        "(for a loss the model computes from its labels, give your own with loss_fn or "
        "step_fn, e.g. from the output's logits), or measure the step on a real device with "
        "memlab.whatif.run."
    )


def installed(filename: str) -> str | None:
    """The name of the installed package (in site-packages) that holds ``filename``, else
    None: the user's own code."""
    for root in _site_roots():
        if filename.startswith(root + "/"):
            parts = Path(filename[len(root) + 1 :]).parts
            return parts[0].removesuffix(".py") if parts else None
    return None


def _site_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = {paths["purelib"], paths["platlib"], *getattr(site, "getsitepackages", list)()}
    return sorted((r.rstrip("/") for r in roots if r), key=len, reverse=True)


def _tensors_read(frame: FrameType, text: str) -> list[str]:
    """The names of the frame's tensor variables that its line mentions."""
    return [
        name
        for name, value in frame.f_locals.items()
        if isinstance(value, torch.Tensor) and re.search(rf"\b{re.escape(name)}\b", text)
    ]
