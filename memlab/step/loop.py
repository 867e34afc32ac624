"""What a ``step_fn`` written as the user's own training loop may do, and what memlab does
about it while it runs (`watching`, one call of step_fn; `OwnLoop`, the whole run):

- ``loss.backward()`` and ``clip_grad_norm_`` run as written (memlab sees the gradients land);
- ``zero_grad()`` (the model's or an optimizer's) runs once per step: with ``accumulation=k``
  memlab calls step_fn k times per step, and a zero_grad in each call would throw the earlier
  micro-batches' gradients away, so the calls after the first are skipped, as a loop that
  accumulates zeroes once per optimizer step. ``set_to_none=False`` is honoured between steps
  too: memlab's own zeroing after its optimizer step then keeps the gradients allocated;
- a learning-rate scheduler's ``step()`` runs, and the scheduler and its optimizer's
  hyper-parameters (the learning rates) are put back when the run ends;
- an optimizer of the user's own is refused before it steps, and so is a ``GradScaler``'s
  ``unscale_`` of it (which a ``scaler.step`` would do first): either would change state the
  user keeps (the optimizer's, or the scaler's record that it unscaled that optimizer).

Calls on other threads (the user training in the kernel while the panel's run goes on) are
left alone; autograd's own threads count as the run's.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.optim.optimizer import register_optimizer_step_pre_hook

from memlab.core import _torch
from memlab.step.config import WhatIfError
from memlab.step.model import OWN_OPTIMIZERS
from memlab.step.writes import Writes

#: What to do when a step must run as the user wrote it (their own optimizers, several models).
TRACK_INSTEAD = (
    "to measure your own training step as it is written, run it under "
    "`with memlab.track(breakdown=True) as t:` (`%%gpumem -b` in a notebook)"
)


def own_optimizer(what: str) -> str:
    """Why step_fn may not step (or unscale for a step) an optimizer of its own."""
    return (
        f"step_fn called {what} on an optimizer of its own: memlab.whatif.run makes the "
        "optimizer RunConfig names (optimizer='sgd', 'adam', ...) and steps it after step_fn, "
        "once per step (accumulation=k calls step_fn k times). Leave optimizer.step() (and a "
        "GradScaler's unscale_(), step() and update()) out of step_fn (loss.backward() and "
        "clip_grad_norm_ may stay, and so may zero_grad() and a scheduler's step(), which "
        "memlab puts back), and return the loss. Two models with an optimizer each (a GAN): "
        "wrap them in one nn.ModuleDict that model_fn returns and return the sum of their "
        f"losses (one optimizer over both), or, {TRACK_INSTEAD}."
    )


class OwnLoop:
    """One run's record of what step_fn did to the training objects: its zero_grad calls, the
    schedulers it stepped (kept to be put back by `kept`), and which micro-batch is running."""

    def __init__(self, writes: bool = False) -> None:
        self.thread = threading.get_ident()
        #: The tensors outside the model step_fn writes, kept while it warms up (`Writes`).
        self.writes = Writes() if writes else None
        self.warming = True
        #: The micro-batch of the step now running (0: the first).
        self.micro = 0
        #: What step_fn's zero_grad asked for: None (never called), or its ``set_to_none``.
        self.zeroed: bool | None = None
        self.schedulers: dict[int, tuple[Any, dict[str, Any], list[tuple[dict[str, Any], Any]]]]
        self.schedulers = {}

    @property
    def set_to_none(self) -> bool:
        """How memlab zeroes the gradients after its optimizer step: as step_fn does, else
        PyTorch's default (freed)."""
        return self.zeroed is not False

    def mine(self) -> bool:
        """Whether the calling thread is the run's (or one of autograd's, in a backward)."""
        here = threading.current_thread()
        return threading.get_ident() == self.thread or isinstance(here, threading._DummyThread)

    def zero_grad(self, original: Callable[..., Any], target: Any, set_to_none: bool) -> Any:
        if not self.mine() or (
            isinstance(target, torch.optim.Optimizer) and target in OWN_OPTIMIZERS
        ):
            return original(target, set_to_none)
        if self.micro > 0:  # a later micro-batch: the step's one zero_grad has been done
            return None
        self.zeroed = bool(set_to_none) if self.zeroed is None else self.zeroed and set_to_none
        return original(target, set_to_none)

    def scheduler_stepped(self, sched: Any) -> None:
        if not self.mine() or id(sched) in self.schedulers:
            return
        own = {k: list(v) if isinstance(v, list) else v for k, v in vars(sched).items()}
        for held in own.values():  # SequentialLR's, ChainedScheduler's: changed without step()
            for inner in held if isinstance(held, list) else ():
                if isinstance(inner, lr_scheduler.LRScheduler):
                    self.scheduler_stepped(inner)
        opt = getattr(sched, "optimizer", None)
        groups = [
            (
                g,
                {
                    k: v.clone() if isinstance(v, torch.Tensor) else copy.copy(v)
                    for k, v in g.items()
                    if k != "params"
                },
            )
            for g in getattr(opt, "param_groups", ())
        ]
        self.schedulers[id(sched)] = (sched, own, groups)

    @contextlib.contextmanager
    def kept(self) -> Iterator[OwnLoop]:
        """The run; at its end, each scheduler step_fn stepped and its optimizer's
        hyper-parameters as they were before."""
        try:
            yield self
        finally:
            for sched, own, groups in reversed(self.schedulers.values()):
                vars(sched).clear()
                vars(sched).update(own)
                for group, values in groups:
                    _put_back(group, values)
            if self.writes is not None:
                self.writes.put_back()

    def notes(self, accumulation: int) -> list[str]:
        """What the report says about the loop step_fn runs."""
        notes = []
        if self.zeroed is not None and accumulation > 1:
            notes.append(
                f"step_fn zeroes the gradients: with accumulation={accumulation} memlab calls "
                "it once per micro-batch and lets its zero_grad() run in the first only, as a "
                "loop that accumulates zeroes once per optimizer step"
            )
        if self.zeroed is False:
            notes.append(
                "step_fn zeroes the gradients with set_to_none=False: memlab keeps them "
                "allocated (zeroed) between steps too, as that loop does"
            )
        if self.writes is not None and self.writes.kept:
            notes.append(
                f"step_fn writes into {len(self.writes.kept)} tensor(s) from outside the model "
                "(an EMA copy of it, a running total): they were put back as they were after "
                "the run"
            )
        if self.schedulers:
            names = sorted({type(s).__name__ for s, _, _ in self.schedulers.values()})
            notes.append(
                f"step_fn steps a learning-rate scheduler ({', '.join(names)}): it and its "
                "optimizer's learning rates were put back as they were after the run"
            )
        return notes


def _put_back(group: dict[str, Any], values: dict[str, Any]) -> None:
    for k in [k for k in group if k != "params" and k not in values]:
        del group[k]
    for k, v in values.items():
        now = group.get(k)
        if isinstance(v, torch.Tensor) and isinstance(now, torch.Tensor) and now.shape == v.shape:
            with torch.no_grad():
                now.copy_(v)  # a tensor learning rate a scheduler filled in place
        else:
            group[k] = v


#: What PyTorch's schedulers read to warn that one stepped before its optimizer did. In a run
#: the optimizer that steps is memlab's, never the program's, so the warning would blame the
#: program's order: the scheduler's optimizer is said to have stepped, for the call alone.
_STEPPED = "_opt_called"


def _schedulers() -> list[type]:
    """The scheduler classes that define their own ``step`` (the others inherit one)."""
    found: list[type] = [lr_scheduler.LRScheduler]
    for cls in vars(lr_scheduler).values():
        own = isinstance(cls, type) and issubclass(cls, lr_scheduler.LRScheduler)
        if own and cls not in found and "step" in vars(cls):
            found.append(cls)
    return found


def _patches(loop: OwnLoop) -> list[tuple[Any, str, Any]]:
    def zero(owner: type) -> Any:
        original = vars(owner)["zero_grad"]

        def zero_grad(self: Any, set_to_none: bool = True) -> Any:
            return loop.zero_grad(original, self, set_to_none)

        return zero_grad

    def stepping(owner: type) -> Any:
        original = vars(owner)["step"]

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            loop.scheduler_stepped(self)
            opt = getattr(self, "optimizer", None)
            if not loop.mine() or opt is None or getattr(opt, _STEPPED, False):
                return original(self, *args, **kwargs)
            try:  # (see _STEPPED; never warnings.catch_warnings: not for a panel's thread)
                setattr(opt, _STEPPED, True)
            except Exception:
                return original(self, *args, **kwargs)
            try:
                return original(self, *args, **kwargs)
            finally:
                with contextlib.suppress(Exception):
                    delattr(opt, _STEPPED)

        return step

    unscale = vars(torch.amp.GradScaler)["unscale_"]

    def unscale_(self: Any, optimizer: torch.optim.Optimizer) -> Any:
        if optimizer not in OWN_OPTIMIZERS and loop.mine():
            raise WhatIfError(own_optimizer(f"GradScaler.unscale_({type(optimizer).__name__})"))
        return unscale(self, optimizer)

    return [
        (nn.Module, "zero_grad", zero(nn.Module)),
        (torch.optim.Optimizer, "zero_grad", zero(torch.optim.Optimizer)),
        (torch.amp.GradScaler, "unscale_", unscale_),
        *((cls, "step", stepping(cls)) for cls in _schedulers()),
    ]


@contextlib.contextmanager
def watching(
    model: nn.Module, loop: OwnLoop | None = None, batch: list[torch.Tensor] | None = None
) -> Iterator[list[int]]:
    """While step_fn runs: the gradients its own backward accumulates into ``model``'s
    parameters (one entry each), a clear error, before it steps, for an optimizer of its own
    (memlab makes and steps the run's optimizer; stepping another would change the user's
    optimizer and count its state as well), and ``loop``'s watch over its zero_grad,
    schedulers and gradient scalers."""
    grads: list[int] = []
    loop = loop if loop is not None else OwnLoop()

    def refuse(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if opt in OWN_OPTIMIZERS or not loop.mine():  # optimizer_in_backward's, or another
            return  # thread's (the user training in the kernel while the panel's run goes on)
        raise WhatIfError(own_optimizer(f"{type(opt).__name__}.step()"))

    handles = []
    try:  # each hook removed, also when interrupted while they go in
        handles.append(register_optimizer_step_pre_hook(refuse))
        for p in model.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(lambda _: grads.append(1)))
        writes = loop.writes if loop.warming else None
        if writes is not None:
            writes.claim(model, batch or [])
        with _torch.patched(_patches(loop)), writes or contextlib.nullcontext():
            yield grads
    finally:
        for h in handles:
            h.remove()
