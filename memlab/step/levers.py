"""The levers of a step that change how it runs (RunConfig fields named after what they do),
applied for a run and taken away after it.

- ``expandable_segments``: the CUDA caching allocator's setting. It is read once, when CUDA
  starts (``PYTORCH_CUDA_ALLOC_CONF``), and memlab never changes the environment: a measured run
  says so in its notes; the estimator models it (`memlab.estimate.expandable`).
- ``optimizer_in_backward``: one optimizer per parameter, stepped by a hook
  (``Tensor.register_post_accumulate_grad_hook``, torch >= 2.1) as soon as backward has
  accumulated that parameter's gradient, which is then freed: the step never holds all the
  gradients at once (PyTorch's tutorial "How to save memory by fusing the optimizer step into
  the backward pass").
- ``checkpoint_saves="matmuls"``: selective activation checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``, torch >= 2.4): inside the
  checkpointed blocks the outputs of matrix products are kept, the rest recomputed in backward.
- ``optimizer_state_bits=8``: Adam's two states in bitsandbytes' 8-bit block-wise layout
  (`memlab.step.adam8bit`): one byte per element each, a float32 scale per block of 256.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from memlab.step.adam8bit import Adam8bit
from memlab.step.config import Optimizer, RunConfig, WhatIfError
from memlab.step.model import OWN_OPTIMIZERS, optimizer


class StepInBackward(torch.optim.Optimizer):
    """The optimizer of a step whose parameters are stepped in backward, each by its own
    optimizer; ``step()`` and ``zero_grad()`` have nothing left to do."""

    def __init__(self, params: list[nn.Parameter], make: Callable[[nn.Module], Any]) -> None:
        super().__init__(params, {})
        self.inner: dict[int, torch.optim.Optimizer] = {}
        self.handles = []
        for p in params:
            holder = nn.Module()  # optimizer() takes a model: one holding just this parameter
            holder.p = p
            self.inner[id(p)] = make(holder)
            self.handles.append(p.register_post_accumulate_grad_hook(self._stepped))

    def _stepped(self, p: torch.Tensor) -> None:
        opt = self.inner[id(p)]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


#: The ops whose outputs selective checkpointing keeps for ``checkpoint_saves="matmuls"``.
MATMULS = ("mm", "addmm", "bmm", "baddbmm")


def selective(config: RunConfig) -> Callable[[], Any] | None:
    """Checkpoint's ``context_fn`` for ``config.checkpoint_saves`` (None: save nothing)."""
    if config.checkpoint_saves == "nothing":
        return None
    make = getattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts", None)
    if make is None:
        raise WhatIfError(
            f"checkpoint_saves={config.checkpoint_saves!r} needs selective checkpointing, "
            f"new in torch 2.5 (this is {torch.__version__}): upgrade torch, or pass "
            "checkpoint_saves='nothing'."
        )
    ops = [getattr(torch.ops.aten, name).default for name in MATMULS]
    return functools.partial(make, ops)


def make_optimizer(
    model: nn.Module, config: RunConfig, foreach: bool | None
) -> torch.optim.Optimizer:
    """The optimizer ``config`` names; with ``optimizer_state_bits=8``, `Adam8bit` (AdamW with
    bitsandbytes' AdamW8bit default weight decay, 0.01)."""
    if config.optimizer_state_bits != 8:
        return optimizer(model, config, foreach)
    params = [p for p in model.parameters() if p.requires_grad]
    adamw = config.optimizer == Optimizer.ADAMW
    opt = Adam8bit(params, lr=config.lr, weight_decay=0.01 if adamw else 0.0, decoupled=adamw)
    OWN_OPTIMIZERS.add(opt)
    return opt


@contextlib.contextmanager
def stepping(
    model: nn.Module,
    config: RunConfig,
    foreach: bool | None,
    make: Callable[[nn.Module, RunConfig, bool | None], torch.optim.Optimizer] | None = None,
) -> Iterator[torch.optim.Optimizer | None]:
    """The step's optimizer (None when it does not train): ``make``'s where given (the host's,
    with optimizer offload); with ``optimizer_in_backward``, a `StepInBackward` whose hooks are
    removed at the end."""
    if not config.training:
        yield None
        return
    if make is not None:
        yield make(model, config, foreach)
        return
    if not config.optimizer_in_backward:
        yield make_optimizer(model, config, foreach)
        return
    params = [p for p in model.parameters() if p.requires_grad]
    fused = StepInBackward(params, lambda holder: make_optimizer(holder, config, foreach))
    try:
        yield fused
    finally:
        fused.remove()


def lever_notes(config: RunConfig, device: torch.device) -> list[str]:
    """What a measured run on ``device`` says about the levers it cannot apply itself."""
    notes = []
    if config.expandable_segments and device.type != "meta":
        where = (
            "this run measures the allocator as PYTORCH_CUDA_ALLOC_CONF set it when CUDA started"
            if device.type == "cuda"
            else f"nothing changes on {device.type}"
        )
        notes.append(
            "expandable_segments changes the CUDA caching allocator's reserved memory: "
            f"{where}; simulate a GPU to predict it"
        )
    if config.optimizer_state_bits == 8 and config.training:
        notes.append(
            "8-bit optimizer state: bitsandbytes' Adam8bit layout (1 byte per element per state, "
            "a float32 scale per block of 256) modelled by its storage bytes, its update computed "
            "in torch (bitsandbytes needs CUDA): the state's bytes are bitsandbytes', the step's "
            "temporaries are not"
        )
    return notes
