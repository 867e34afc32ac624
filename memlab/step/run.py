"""Run one step under a configuration, measured, and leave the user's model as it was.

What differs when the estimator runs the step on ``meta`` (its autocast emulation, the
optimizer's ``foreach``, no gradient scaler, a callback around the measured step) is passed in
as `StepHooks`: this module never imports the estimator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import traceback
from collections.abc import Callable
from typing import Any

import torch

from memlab.core.categories import Category
from memlab.core.frames import users_traceback
from memlab.core.ledger import default_ledger
from memlab.core.warmup import warm_up
from memlab.region import track
from memlab.reports.oom import OOMExplanation
from memlab.reports.report import MemoryReport
from memlab.step.base_weights import quantized_base
from memlab.step.compiled import CompiledRegion, compiled, compiling, warmups
from memlab.step.config import Amp, Mode, Retention, RunConfig, WhatIfError
from memlab.step.generate import Stage, generate, unstaged
from memlab.step.hooks import StepHooks as StepHooks  # its home: memlab.step.hooks
from memlab.step.kvcache import cache_note
from memlab.step.levers import lever_notes, selective, stepping
from memlab.step.loop import OwnLoop
from memlab.step.model import (
    allocated,
    autocast_of,
    call,
    check_device,
    check_scalable,
    checkpointed,
    config_of,
    random_kept,
    resolve_device,
    restored,
    skipped,
)
from memlab.step.offload import HostOffload, unmarked
from memlab.step.outputs import detach
from memlab.step.ranks import of_run, units_of
from memlab.step.result import RunResult
from memlab.step.user import (
    InputFn,
    LossFn,
    ModelFn,
    StepFn,
    UserStep,
    check_model_fn,
    check_trainable,
    module_of,
)

#: Warm-up steps tried again at most, while an fp16 scaler skips the optimizer's step.
SCALER_RETRIES = 8


@users_traceback(own=(WhatIfError,))
def run(
    model_fn: ModelFn,
    input_fn: InputFn,
    loss_fn: LossFn | None = None,
    config: RunConfig | None = None,
    *,
    step_fn: StepFn | None = None,
    hooks: StepHooks | None = None,
    **settings: Any,
) -> RunResult:
    """A warm-up step, then one measured step under ``config``: what the step's memory peaks
    at, and what it is made of (parameters, gradients, optimizer state, activations, ...).

    model_fn(): the model, on the run's device. A new one each call keeps runs isolated; if it
        returns your existing model, memlab restores its weights, buffers, gradients, train/eval
        modes and forwards afterwards, also when the run fails or is interrupted; and torch's
        random state (on the main thread: docs/reliability.md).
    input_fn(batch_size): the model's input: a tensor, a tuple (the arguments) or a mapping (the
        keyword arguments, e.g. ``input_ids`` and ``labels`` for a Hugging Face model).
    loss_fn(output): a scalar loss (default: the model's own ``loss`` where the output is a
        mapping that has one, as a Hugging Face model given labels returns; otherwise the mean
        square of the output's first tensor).
    step_fn(model, batch): your own forward and loss, for a loss that needs targets: ``batch``
        is what input_fn returned, as it is; return the scalar loss (in no_grad or
        inference_mode, return the output). E.g. ``lambda model, b: F.cross_entropy(model(b[0]),
        b[1])`` or, for a Hugging Face model, ``lambda model, b: model(**b).loss``. It may run
        ``loss.backward()`` (and ``clip_grad_norm_``) itself; memlab makes and steps the
        optimizer. Give either loss_fn or step_fn.
    hooks: how the step runs for a prediction (`StepHooks`; the estimator passes them).
    settings: RunConfig fields that override ``config`` (``run(m, x, batch_size=32)``).
    Raises WhatIfError for inputs it cannot run; an out-of-memory run is a result (oom=True).

    >>> def batch(n):
    ...     return torch.randn(n, 512, device="cuda"), torch.randint(0, 10, (n,), device="cuda")
    >>> r = memlab.whatif.run(lambda: Net().cuda(), batch, batch_size=64, amp="bf16",
    ...                       step_fn=lambda model, b: F.cross_entropy(model(b[0]), b[1]))
    >>> r.peak, r.report.breakdown.at_peak
    """
    config = config_of(config, settings)
    check_model_fn(model_fn)
    if step_fn is not None and loss_fn is not None:
        raise WhatIfError(
            "give loss_fn or step_fn, not both: step_fn(model, batch) computes the loss itself."
        )
    if step_fn is not None and not callable(step_fn):
        raise WhatIfError(
            f"step_fn must be a function of (model, batch), not {type(step_fn).__name__}."
        )
    device = resolve_device(config.device)
    with random_kept(device):  # the notebook's random sequence stays where it was
        return _run(model_fn, input_fn, loss_fn, config, step_fn, hooks or StepHooks(), device)


def _run(
    model_fn: ModelFn,
    input_fn: InputFn,
    loss_fn: LossFn | None,
    config: RunConfig,
    step_fn: StepFn | None,
    hooks: StepHooks,
    device: torch.device,
) -> RunResult:
    # PyTorch imports torch._dynamo on the first optimizer or dispatch mode, and the import keeps
    # the frames on its stack in a reference cycle: warm_up() does it on a thread of its own, and
    # must come before this run builds its optimizer, which would do it here otherwise.
    warm_up()
    model = module_of(call("model_fn", model_fn))
    check_device("the model", [*model.parameters(), *model.buffers()], device)
    training = config.training
    check_trainable(model, config)
    units = units_of(model) if config.world_size > 1 else ()  # FSDP's units, before any wrapping
    off = HostOffload(config, device, model)  # offload="off": the device's own optimizer
    on_host = off.make_optimizer if off.offload.optimizer else None
    with (
        OwnLoop(_writes(step_fn, config, device)).kept() as loop,  # put back after the rest
        quantized_base(model, config) as based,  # base_weights: before restored() sees them
        restored(model, weights=training) as left,  # and the earlier runs' models alive
        checkpointed(model, config.checkpoint, selective(config)) as chosen,
        stepping(model, config, hooks.foreach, on_host) as opt,
    ):
        fp16 = training and config.amp == Amp.FP16 and hooks.grad_scaler
        scaler = torch.amp.GradScaler(device.type) if fp16 else None
        amp = autocast_of(config.amp, device, hooks.autocast)
        user = UserStep(compiled(model, config, device), input_fn, loss_fn, step_fn, device, loop)
        step = functools.partial(_step, user, config, opt, scaler, amp, off)
        # a generation's warm-up pays the one-time costs with a prefill and one decode step
        few = min(2, config.new_tokens)
        one = config.with_(new_tokens=few) if config.mode == Mode.GENERATE else config
        warm = functools.partial(_step, user, one, opt, scaler, amp, off)
        # what existed before the run (earlier runs' models still alive, a notebook's tensors
        # memlab already knows) left out on the CPU, as in a fresh process (`step.leftovers`)
        known = device.type == "cpu" and default_ledger().total("cpu") > 0
        fresh = (bool(left.held) or known) and not hooks.since and not config.compile
        since = default_ledger().next_serial() if fresh else hooks.since
        region: track | CompiledRegion = (  # a compiled step: measured without a dispatch mode
            CompiledRegion(device, config, model, opt)
            if config.compile
            else track(device, breakdown=True, timeline=True, watch=[model], since=since)
        )
        try:
            if config.warmup:
                with compiling(config, device):  # torch.compile compiles here, or says why not
                    for _ in range(warmups(config)):
                        warm(unmarked, unstaged)
                # with fp16, the scaler skips the optimizer's step while the scaled gradients
                # overflow (often the first steps, at its initial scale): warm up again until
                # one is taken, so the measured step finds the optimizer's state in place
                for _ in range(SCALER_RETRIES if scaler is not None else 0):
                    if not skipped(opt):
                        break
                    warm(unmarked, unstaged)
            loop.warming = False  # the measured step writes what the warm-up wrote
            if hooks.on_measure is not None:
                hooks.on_measure("start")
            with region:
                for p in model.parameters() if fresh else ():
                    region.mark(p, Category.PARAMETER)  # this run's own, known before or not
                if hooks.on_measure is not None:
                    hooks.on_measure("opened")  # the region's clock has started
                kept, series = step(functools.partial(_mark, region), region.phase)
            if config.mode == Mode.GENERATE:
                chosen.append(cache_note(model, config, kept[1], kept[2], user.prefilled))
            chosen += lever_notes(config, device) + based.notes + user.notes(config)
            chosen += left.notes(device, left_out=fresh)
            chosen += loop.notes(config.accumulation)
            del kept
            if hooks.on_measure is not None:
                hooks.on_measure("end")
        except torch.cuda.OutOfMemoryError as e:
            explained = _explained(hooks, e, config, region.targets[0].name)
            traceback.clear_frames(e.__traceback__)  # the frames hold the step's tensors
            message = str(e).splitlines()[0]
            del e
            try:  # an OOM in the measured step still has its report; one in the warm-up has none
                report: MemoryReport | None = region.report
            except RuntimeError:
                report = None
            return RunResult(
                config,
                report,
                oom=True,
                error=f"CUDA out of memory: {message}",
                explanation=explained,
            )
    report = off.attach(region.report)  # with what the step kept in host memory
    if chosen:  # what checkpoint='auto' chose, and what it turned off
        report = dataclasses.replace(report, notes=(*report.notes, *chosen))
    ranks = of_run(config, report.breakdown, units)  # one rank's share, for world_size > 1
    peak = report.peak_allocated if ranks is None else ranks.total
    over = config.budget is not None and peak > config.budget
    error = (
        f"the peak{'' if ranks is None else ' a rank'} ({peak:,} B) exceeds the budget "
        f"({config.budget:,} B)"
        if over
        else None
    )
    return RunResult(config, report, oom=over, error=error, series=tuple(series), ranks=ranks)


def _writes(step_fn: StepFn | None, config: RunConfig, device: torch.device) -> bool:
    """Whether the run keeps what step_fn writes outside the model (`memlab.step.writes`)."""
    return step_fn is not None and config.warmup and not config.compile and device.type != "meta"


def _explained(
    hooks: StepHooks, e: BaseException, config: RunConfig, device: str
) -> OOMExplanation | None:
    if hooks.on_oom is None:
        return None
    try:
        return hooks.on_oom(e, config, device)
    except Exception:  # the run's own result comes first: without an explanation
        return None


def _step(
    user: UserStep,
    config: RunConfig,
    opt: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler | None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    off: HostOffload,
    mark: Callable[..., None],
    stage: Stage,
) -> tuple[list[Any], list[int]]:
    model, device = user.model, user.device
    if config.retention != Retention.OFF:  # evaluation with grad enabled, outputs kept
        model.eval()
        kept, series = [], []
        for _ in range(config.iterations):
            with autocast():
                out = user.forward(config.batch_size, mark)
            kept.append(out if config.retention == Retention.ATTACHED else detach(out))
            series.append(allocated(device))
        return kept, series
    if config.mode == Mode.GENERATE:
        model.eval()
        with autocast():
            return generate(user, config, mark, stage), []
    if config.mode == Mode.EVAL_WITH_GRAD:
        model.eval()
        with autocast():
            return [user.forward(config.batch_size, mark)], []
    if config.mode != Mode.TRAIN:
        model.eval()
        grad = torch.no_grad() if config.mode == Mode.NO_GRAD else torch.inference_mode()
        with grad, autocast():
            out = user.forward(config.batch_size, mark)
        return [out], []
    assert opt is not None
    model.train()
    with off.step(mark):  # offload: the host copies counted, and marked
        micro = config.batch_size // config.accumulation
        for i in range(config.accumulation):
            user.loop.micro = i  # step_fn's own zero_grad runs in the first only
            with autocast():
                out = user.forward(micro, mark)
                loss = user.loss(out, config.accumulation)  # None: step_fn ran backward
            user.backward(loss, scaler)
            del out, loss
        check_scalable(model, config, user.own_backward)  # fp16 parameters: before the scaler
        if scaler is not None and not user.own_backward:  # theirs was not scaled
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    opt.zero_grad(set_to_none=user.loop.set_to_none)  # as step_fn's own zero_grad, if any
    return [], []


def _mark(
    region: track | CompiledRegion, t: torch.Tensor, category: Category = Category.INPUT
) -> None:
    region.mark(t, category)
