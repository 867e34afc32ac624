"""What the warm-up step does differently from the measured one: on a GPU it runs without
memlab's dispatch mode, and PyTorch's composite functions then take their in-place branches.

Several composites ask ``isTensorSubclassLike`` whether to write in place, and it answers yes
whenever a Python dispatch mode is active (``c10::impl::dispatch_mode_enabled``). The measured
step runs under memlab's accounting, a dispatch mode, on a GPU as on ``meta``; the warm-up step
runs under one only on ``meta``. So on a GPU, in the warm-up only:

- ``F.linear`` on an input it does not flatten (a strided input of three or more dimensions,
  as ``nn.MultiheadAttention`` with ``batch_first`` passes it) computes the product and adds
  the bias into it (``output.add_(bias)``), where under a mode it allocates the sum anew;
- the autograd engine accumulates a gradient that arrives twice into the first (or the
  second) of the two (``InputBuffer::accumulate``: ``old.add_(new)``), where under a mode it
  allocates the sum anew.

The warm-up's allocations do not count in the measured peaks, but they shape the cache the
measured step finds: on the encoder's checkpointed step, the transient sums moved 144 MiB of
peak reserved (tests/data/validation/encoder-bert-base-width-checkpoint-adam). `Unmeasured`
emulates both while the estimate's warm-up runs; the estimator turns it off where the measured
step starts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from memlab.core import _torch
from memlab.estimate.autocast import _region

aten = torch.ops.aten


class Unmeasured:
    """Whether the step being estimated is in its warm-up (no dispatch mode on a GPU)."""

    def __init__(self) -> None:
        self.active = False


#: The estimate running now (one at a time: the autocast emulation patches torch too).
STATE = Unmeasured()


def plain_linear(original: Any) -> Any:
    """``F.linear`` that, in the warm-up, adds the bias in place where a GPU's would."""

    def linear(input: Any, weight: Any, bias: Any = None) -> Any:
        if (
            STATE.active
            and bias is not None
            and isinstance(input, torch.Tensor)
            and input.device.type == "meta"
            and input.dim() > 2
            and not input.is_contiguous()  # a contiguous input is flattened: one addmm
            and _region() is None  # under autocast the casts are the composite's own
        ):
            output = torch.matmul(input, weight.t())
            output.add_(bias)
            return output
        return original(input, weight, bias)

    return linear


def linear_patch() -> tuple[Any, str, Any]:
    """(``torch.nn.functional``, "linear", `plain_linear`), for `_torch.patched`."""
    return (F, "linear", plain_linear(F.linear))


def accumulated(func: Any, args: tuple[Any, ...], kwargs: Any) -> torch.Tensor | None:
    """In the warm-up's backward, the autograd engine's sum of a gradient that arrives twice,
    made in place in the first of the two that is dense (as without a dispatch mode); None for
    any other op, or when neither is."""
    if not STATE.active or func is not aten.add.Tensor or kwargs or len(args) != 2:
        return None
    old, new = args
    if (
        torch.is_grad_enabled()
        or _torch.current_autograd_node() is None  # not in backward
        or not isinstance(new, torch.Tensor)
        or old.shape != new.shape
        or old.dtype != new.dtype
        or old.device != new.device
    ):
        return None
    for into, other in ((old, new), (new, old)):
        if into.is_contiguous() and not into.requires_grad:
            return into.add_(other)
    return None
