"""The user's side of a step: their model, their inputs, their forward and loss."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from memlab.core.frames import message_of, users_unless_memlab_s
from memlab.step.config import Amp, Mode, RunConfig, WhatIfError
from memlab.step.loop import TRACK_INSTEAD, OwnLoop, watching
from memlab.step.model import call, check_input, cpu_to, forward_error, users_call
from memlab.step.outputs import loss_of, returned_loss, tensors_in

ModelFn = Callable[[], nn.Module]
InputFn = Callable[[int], Any]
LossFn = Callable[[Any], torch.Tensor]
StepFn = Callable[[nn.Module, Any], Any]


@dataclass
class UserStep:
    """The user's side of a step: their model, inputs, and forward and loss. ``own_backward``:
    whether the last `forward` ran backward itself (a step_fn that calls ``loss.backward()``)."""

    model: nn.Module
    input_fn: InputFn
    loss_fn: LossFn | None
    step_fn: StepFn | None
    device: torch.device
    #: What step_fn, run as the user's own loop, did to the training objects.
    loop: OwnLoop = field(default_factory=OwnLoop)
    own_backward: bool = field(default=False, init=False)
    #: mode "generate": the cache's bytes after the last prefill (`memlab.step.generate`).
    prefilled: int | None = field(default=None, init=False)

    def forward(self, batch: int, mark: Callable[[torch.Tensor], None]) -> Any:
        """The model on input_fn(batch), or step_fn(model, input_fn(batch)). Without step_fn, a
        tuple is the forward's arguments, a mapping its keyword arguments (``{"input_ids": ...,
        "labels": ...}`` for a Hugging Face model), anything else its one argument."""
        value = call("input_fn", self.input_fn, batch)
        if self.device.type == "meta":  # an estimate: a batch from the CPU is on the GPU
            value = cpu_to(value, self.device)
        tensors = tensors_in(value)
        check_input(value, tensors, self.device, self.step_fn is not None)
        for t in tensors:
            mark(t)
        if self.step_fn is not None:
            with watching(self.model, self.loop, tensors) as grads, grad_off_explained():
                out = users_call(
                    "step_fn", "step_fn(model, batch)", self.step_fn, self.model, value
                )
            self.own_backward = bool(grads)
            return out
        args: tuple[Any, ...] = value if isinstance(value, tuple) else (value,)
        kwargs: dict[str, Any] = {}
        if isinstance(value, Mapping):
            args, kwargs = (), dict(value)
        try:
            return self.model(*args, **kwargs)
        except Exception as e:
            if isinstance(e, TypeError) and refused_arguments(e) and kwargs:
                raise WhatIfError(
                    f"the model's forward refused the keyword argument(s) input_fn returned "
                    f"({', '.join(map(str, kwargs))}: {message_of(e)}). Return a dict of the "
                    f"names its forward takes{_parameters_of(self.model)}, or give your own "
                    "forward: step_fn=lambda model, batch: ..."
                ) from e
            if isinstance(e, TypeError) and refused_arguments(e):
                raise WhatIfError(
                    f"the model's forward refused the {len(args)} argument(s) input_fn "
                    f"returned ({message_of(e)}). If input_fn returns (inputs, targets), give "
                    "your own forward and loss: step_fn=lambda model, batch: "
                    "criterion(model(batch[0]), batch[1])."
                ) from e
            wrapped = forward_error(e, batch, tensors)  # a shape or dtype the model refused
            if wrapped is None:
                users_unless_memlab_s(e)
                raise
            raise wrapped from e

    def loss(self, out: Any, accumulation: int = 1) -> torch.Tensor | None:
        """The training step's loss, divided for ``accumulation``; None when step_fn ran
        backward itself (what it returned is then not used)."""
        if self.step_fn is None:
            return loss_of(self.loss_fn, out) / accumulation
        if self.own_backward:
            return None
        loss = returned_loss(out)
        if loss is None:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            number = isinstance(out, (int, float))
            raise WhatIfError(
                f"step_fn must return the scalar loss in training, not {got}"
                + (" (a number, such as loss.item(), has no graph for backward)" if number else "")
                + ": e.g. end it with criterion(model(x), y), or model(**batch).loss for a "
                "Hugging Face model, or a dict or tuple that holds it ({'loss': loss, ...}, "
                f"(loss, logits)); or call loss.backward() in it. Or, {TRACK_INSTEAD}."
            )
        return loss / accumulation

    def notes(self, config: RunConfig) -> list[str]:
        """What the report says about a step_fn that ran backward itself."""
        if not self.own_backward or config.amp == Amp.OFF:
            return []
        return [
            f"step_fn ran backward itself, inside the run's autocast (amp={config.amp.value}): "
            "the weights' casts autocast caches stay through backward, and no gradient scaler "
            "is used; return the loss instead to have memlab run backward after autocast, as a "
            "training loop does"
        ]

    def backward(self, loss: torch.Tensor | None, scaler: Any) -> None:
        """``loss.backward()`` (scaled by ``scaler`` when there is one), unless step_fn ran its
        own (``loss`` None)."""
        if loss is None:
            return
        if not loss.requires_grad:
            raise WhatIfError(
                "The loss does not require grad, so backward has nothing to do: is the forward "
                "run under torch.no_grad(), or are all the parameters it uses frozen? For a "
                "forward alone, use mode='no_grad'."
            )
        try:
            (scaler.scale(loss) if scaler is not None else loss).backward()
        except RuntimeError as e:
            if self.step_fn is None or "a second time" not in message_of(e):
                raise
            raise WhatIfError(
                "step_fn ran backward through the loss it returned, but not into the model "
                "model_fn made (its graph is already freed): memlab runs backward itself, so "
                "return the loss without calling backward; for models outside model_fn's (two "
                "models, as in a GAN), wrap them in one nn.ModuleDict that model_fn returns, or, "
                f"{TRACK_INSTEAD}."
            ) from e


def check_trainable(model: nn.Module, config: RunConfig) -> None:
    """A WhatIfError for a model a step with grad cannot run: a training step's without
    trainable parameters, and one made under ``torch.inference_mode()`` (autograd refuses to
    save its tensors, deep in the forward)."""
    if config.training and not any(p.requires_grad for p in model.parameters()):
        raise WhatIfError(
            "The model has no trainable parameters, so a training step has nothing to do: use "
            "mode='no_grad', or unfreeze some parameters."
        )
    if config.mode not in (Mode.TRAIN, Mode.EVAL_WITH_GRAD):
        return
    made = [name for name, p in model.named_parameters() if p.is_inference()]
    if made:
        raise WhatIfError(
            f"model_fn returned a model made under torch.inference_mode() ({len(made)} "
            f"parameter(s) are inference tensors, {made[0]!r} first): autograd cannot save them "
            f"for backward, so mode={str(config.mode)!r} cannot run it. Build the model outside "
            "inference_mode (under torch.no_grad() if you like), or pass mode='no_grad' or "
            "mode='inference_mode'."
        )


def check_model_fn(model_fn: Any) -> None:
    """A WhatIfError where ``model_fn`` is not a function that returns the model: a model
    itself (called with no arguments, its forward would fail on a missing input), or no
    callable at all."""
    if isinstance(model_fn, nn.Module):
        what = type(model_fn).__name__
        raise WhatIfError(
            f"model_fn got a model already built ({what}): pass a function that returns it, "
            f"e.g. model_fn=lambda: model (memlab puts its weights, buffers and gradients back "
            f"after the run), or one that builds a new {what} each call."
        )
    if not callable(model_fn):
        raise WhatIfError(
            f"model_fn got {type(model_fn).__name__} {model_fn!r:.60}: pass a function that "
            "returns the model, e.g. model_fn=lambda: MyModel(config)."
        )


def module_of(value: Any) -> nn.Module:
    """What model_fn returned, if it is a module memlab can measure; else an error that says
    what to pass."""
    if isinstance(value, torch.jit.ScriptModule):
        raise WhatIfError(
            f"model_fn returned a TorchScript module ({type(value).__name__}, made by "
            "torch.jit.script or torch.jit.trace): memlab measures a step op by op, and "
            "TorchScript's executor runs and differentiates its graph itself (what it saves for "
            "backward cannot be told apart as activations, and mode='inference_mode' fails "
            "in it). Return the eager module instead, as it was before torch.jit.script or "
            "torch.jit.trace (model_fn=lambda: model, not the scripted one)."
        )
    if isinstance(value, nn.Module):
        return check_materialised(value)
    got = type(value).__name__
    if isinstance(value, (tuple, list, dict)):
        items = value.values() if isinstance(value, dict) else value
        modules = [m for m in items if isinstance(m, nn.Module)]
        if modules and any(isinstance(m, torch.optim.Optimizer) for m in items):
            raise WhatIfError(
                f"model_fn must return the model alone, not a {got} with an optimizer: memlab "
                "makes the optimizer itself (optimizer='adamw', 'sgd', ..., lr=...). Or, "
                f"{TRACK_INSTEAD}."
            )
        if modules:
            raise WhatIfError(
                f"model_fn must return one torch.nn.Module, not a {got} of {len(value)} "
                "(several models, as a GAN's generator and discriminator): return "
                "nn.ModuleDict({'g': g, 'd': d}) and use models['g'], models['d'] in "
                "step_fn(models, batch), returning the sum of their losses (memlab steps one "
                f"optimizer over both). Or, {TRACK_INSTEAD}."
            )
    raise WhatIfError(f"model_fn must return a torch.nn.Module, not {got}.")


def check_materialised(model: nn.Module) -> nn.Module:
    """``model``; a WhatIfError where a lazy module (``nn.LazyLinear``, ...) has not had the
    forward that gives its parameters their shapes: nothing can be counted or copied yet."""
    lazy = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if is_lazy(t)]
    if lazy:
        raise WhatIfError(
            f"model_fn returned a model with {len(lazy)} uninitialized lazy parameter(s) "
            f"({lazy[0]!r} first: a LazyLinear, LazyConv2d, ... not yet run): give them their "
            "shapes in model_fn with one forward on a small batch, e.g. "
            "`m = Net(); m(input_fn(1)); return m`."
        )
    return model


@contextlib.contextmanager
def grad_off_explained() -> Iterator[None]:
    """step_fn's own ``loss.backward()`` in a run with grad off (mode='no_grad' or
    'inference_mode'), explained; any other error as it is."""
    try:
        yield
    except RuntimeError as e:
        if torch.is_grad_enabled() or "does not require grad" not in message_of(e):
            raise
        raise WhatIfError(
            "step_fn ran backward with grad off: mode='no_grad' and mode='inference_mode' run "
            "step_fn under torch.no_grad() / torch.inference_mode(), so its loss has no graph "
            f"({message_of(e)}). For a forward alone, return the output without calling "
            "backward; to measure training, pass mode='train'."
        ) from e


def refused_arguments(e: TypeError) -> bool:
    """Whether the TypeError is the forward refusing its arguments (raised where PyTorch calls
    it, not inside it)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    words = ("positional argument", "unexpected keyword argument", "required positional")
    return where.endswith(("module.py", "run.py")) and any(w in message_of(e) for w in words)


def _parameters_of(model: Any) -> str:
    """`` (x, mask)``: the names the model's class's forward takes, or nothing where they
    cannot be read without running the program's code."""
    try:
        names = list(inspect.signature(type(model).forward).parameters)[1:]
    except Exception:
        return ""
    return f" ({', '.join(names)})" if names else ""
